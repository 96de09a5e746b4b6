"""``python tests/as_host.py HOST -c CODE ARG...`` or ``... HOST SCRIPT ARG...``: runs the Python
code or script with ``socket.gethostname()`` answering ``HOST``, where the test cannot give the
process a hostname of its own (``unshare --uts`` needs root)."""

import runpy
import socket
import sys

host, *argv = sys.argv[1:]
socket.gethostname = lambda: host
if argv[0] == "-c":
    sys.argv = ["-c", *argv[2:]]
    exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
else:
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
