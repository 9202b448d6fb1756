"""The test suite. A package so that ``tests.support`` imports by one name everywhere (test
modules, spawned run workers, benchmarks) and the tier folders (``vllm/``, ``ray/``) are never
found as the ``vllm`` or ``ray`` packages through ``sys.path``."""
