"""``python -m attnjax.compile --config CONFIG --target TARGET [--json FILE] [--config.x=y]``."""

import sys

from absl import app, flags
from ml_collections import config_flags

from attnjax import compat
from attnjax.compile import run, targets
from attnjax.train import collector, compilation_cache, config_file

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:arg]).")
_TARGET = flags.DEFINE_string("target", None, f"What to compile for: {targets.FORMS}.")
_JSON = flags.DEFINE_string("json", None, "Also write the report as JSON to this file.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    collector.raise_thresholds()
    if compat.persistent_cache_reloads_compile_only_programs():
        compilation_cache.enable()
    try:
        status = run(
            config_file.loaded(_CONFIG, "attnjax.compile"),
            _TARGET.value,
            config_name=config_flags.get_config_filename(flags.FLAGS["config"]),
            json_path=_JSON.value,
        )
    except ValueError as error:
        print(f"attnjax.compile: error: {error}", file=sys.stderr)
        status = 1
    sys.exit(status)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "target"])
    app.run(main, flags_parser=config_file.flags_parser("attnjax.compile"))
