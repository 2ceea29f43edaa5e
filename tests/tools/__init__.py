"""Test tools that drive a running server or router: the hostile batteries (``hostile*.py``), the soak's traffic
and report (``soak.py``, ``soak_report.py``), the PD fault run's pieces (``pd_faults.py``) and trace replay
(``replay.py``). The tests and ``benchmarks/*.py`` import them as ``tests.tools.<name>``; none is installed with
the library."""
