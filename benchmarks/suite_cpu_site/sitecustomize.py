"""Loaded by every Python process the suite starts while benchmarks/suite_cpu.py runs it (this
folder is on their ``PYTHONPATH``): at a normal exit a process started by a test writes JAX's
stage totals (``suite_cpu_stages.py``) and its CPU seconds to ``$SUITE_CPU_DIR``, under the test
that started it (``$PYTEST_CURRENT_TEST``, which the process inherited). pytest's own processes
report through the suite_cpu plugin instead."""

import atexit
import json
import os
import resource

import suite_cpu_stages as stages

REPORTED_BY_PLUGIN = False  # set by the suite_cpu plugin in the processes that run the tests


def _write_account() -> None:
    out, test = os.environ.get("SUITE_CPU_DIR"), os.environ.get("PYTEST_CURRENT_TEST")
    if REPORTED_BY_PLUGIN or not out or not test:
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    account = dict(
        test=stages.test_name(test.rsplit(" (", 1)[0]),  # "<nodeid> (<phase>)"
        cpu=round(usage.ru_utime + usage.ru_stime, 3),
        stages=stages.snapshot(),
    )
    with open(os.path.join(out, f"process-{os.getpid()}.json"), "w") as f:
        json.dump(account, f)


atexit.register(_write_account)
