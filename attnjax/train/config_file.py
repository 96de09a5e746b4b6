"""A ``--config`` file that cannot be loaded, told in one line naming the file, the line and the
cause (train.py, ``python -m attnjax.compile``).

ml_collections reports such a file in two ways, neither of them one line: an exception from the
file's own code (or a file without ``get_config``) escapes absl's flag parsing as a traceback,
and a file it could not read surfaces only at the config's first use, as "Configuration is not
available because of an earlier failure to load", naming neither the file nor the cause.
"""

from __future__ import annotations

import sys
import traceback
from typing import Callable

from absl import app, flags
from ml_collections import config_flags


def _fail(program: str, path: str, cause: str) -> None:
    verbose = "; --verbose shows the traceback" if "verbose" in flags.FLAGS else ""
    print(
        f"{program}: error: --config {path!r} could not be loaded: {cause} (expected a Python "
        f"file with a get_config(), as configs/*.py{verbose})",
        file=sys.stderr,
    )
    sys.exit(1)


def flags_parser(program: str) -> Callable[[list[str]], list[str]]:
    """For ``app.run(main, flags_parser=...)``: absl's parsing, with a config file's own
    exception as one line (the traceback only where argv holds ``--verbose``)."""

    def parse(argv: list[str]) -> list[str]:
        try:
            return app.parse_flags_with_usage(argv)
        except Exception as error:
            named = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
            named += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"]
            if not named or ("verbose" in flags.FLAGS and "--verbose" in argv):
                raise
            path = named[-1].split(":", 1)[0]
            frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == path]
            where = f"line {frames[-1].lineno}: " if frames else ""
            _fail(program, path, f"{where}{type(error).__name__}: {error}")

    return parse


def loaded(holder: flags.FlagHolder, program: str):
    """``holder``'s config (a ``config_flags.DEFINE_config_file`` flag), or status 1 with one
    line where its file could not be read."""
    config = holder.value
    try:
        config.get("cpu_devices")  # the first use, where a file not read is reported
    except OSError as error:
        path = config_flags.get_config_filename(flags.FLAGS[holder.name])
        _fail(program, path, str(error).strip().splitlines()[-1].strip())
    return config
