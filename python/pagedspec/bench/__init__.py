"""Kernel benchmarks: a registry of cases (``cases_*.py``), timing (``core``), the runner."""
