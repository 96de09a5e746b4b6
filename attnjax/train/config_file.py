"""A ``--config`` file that cannot be loaded, told in one line naming the file, the line and the
cause (train.py, ``python -m attnjax.compile``).

ml_collections reports such a file in two ways, neither of them one line: an exception from the
file's own code (or a file without ``get_config``) escapes absl's flag parsing as a traceback,
and a file it could not read surfaces only at the config's first use, as "Configuration is not
available because of an earlier failure to load", naming neither the file nor the cause.
An override of a field the config lacks (``--config.batchsize=3``) is one line too, naming the
flag: ml_collections raises it while parsing ``--config``, as if the file had failed; and so is
an exception of ``get_config(arg)`` (``--config=file.py:arg``), which ml_collections hands to
absl as a flag error holding the traceback as text.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from typing import Callable

from absl import flags
from ml_collections import config_flags


def _exit(program: str, what: str, cause: str, expected: str) -> None:
    """Status 1 after the one line ``<program>: error: <what>: <cause> (<expected>[; hint])``."""
    verbose = "; --verbose shows the traceback" if "verbose" in flags.FLAGS else ""
    print(f"{program}: error: {what}: {cause} ({expected}{verbose})", file=sys.stderr)
    sys.exit(1)


def _fail(program: str, path: str, cause: str) -> None:
    expected = "expected a Python file with a get_config(), as configs/*.py"
    _exit(program, f"--config {path!r} could not be loaded", cause, expected)


def _last_line(text: str) -> str:
    """The last line of a message that holds a traceback or a list of attempts."""
    return [line.strip() for line in text.splitlines() if line.strip()][-1]


def _override(error: Exception) -> str | None:
    """The flag, ``config.<field path>``, whose override raised ``error`` (ml_collections applies
    every ``--config.<field>`` while parsing ``--config``), else None."""
    parser_module = os.path.join("ml_collections", "config_flags", "config_flags.py")
    tb = error.__traceback__
    while tb is not None:
        code, names = tb.tb_frame.f_code, tb.tb_frame.f_locals
        field = names.get("field_path", names.get("override"))
        if code.co_filename.endswith(parser_module) and isinstance(field, str):
            return f"{getattr(names.get('self'), 'name', 'config')}.{field}"
        tb = tb.tb_next
    return None


def _missing_field(error: Exception) -> tuple[str, str]:
    """``(key, close match or "")`` from ml_collections' error for a missing field: a KeyError
    (maybe inside an AttributeError) whose text is the quoted key, then "Did you mean ..."."""
    while error.args and isinstance(error.args[0], BaseException):
        error = error.args[0]
    text = str(error.args[0]) if error.args else str(error)
    key, *hint = text.split("\n")
    return key.strip("'\""), (hint[-1].strip() if hint else "")


def flags_parser(program: str) -> Callable[[list[str]], list[str]]:
    """For ``app.run(main, flags_parser=...)``: absl's parsing, with a config file's own
    exception, or an override of a field the config does not have, as one line (the traceback
    only where argv holds ``--verbose``)."""

    def parse(argv: list[str]) -> list[str]:
        named = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
        named += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"]
        path = named[-1].split(":", 1)[0] if named else ""
        try:
            return flags.FLAGS(argv)
        except flags.Error as error:
            # ml_collections wraps an exception of ``get_config(arg)`` (``file.py:arg``) in a flag
            # error holding the traceback as text: its last line is the cause.
            text = str(error)
            if named and "Error whilst parsing config file" in text and "--verbose" not in argv:
                at = re.findall(rf'File "{re.escape(path)}", line (\d+)', text)
                _fail(program, path, f"{f'line {at[-1]}: ' if at else ''}{_last_line(text)}")
            sys.stderr.write(f"FATAL Flags parsing error: {text}\n")  # as absl's own parser
            sys.stderr.write("Pass --helpshort or --helpfull to see help on flags.\n")
            sys.exit(1)
        except Exception as error:
            if not named or ("verbose" in flags.FLAGS and "--verbose" in argv):
                raise
            override = _override(error)
            if override and isinstance(error, (AttributeError, KeyError)):
                key, close = _missing_field(error)
                cause = f"the config of {path} has no field {key!r}{f'; {close}' if close else ''}"
                expected = "an override sets a field the config's get_config() made"
                _exit(program, f"--{override}", cause, expected)
            if isinstance(error, OSError):  # a file not read, found when an override is applied
                _fail(program, path, _last_line(str(error)))
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
        _fail(program, path, _last_line(str(error)))
    return config
