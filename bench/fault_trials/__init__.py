"""Issue 31's fault-injection campaign at CPU scale (tiny models, synthetic data): the trials of each
kind and how an outcome is classified. ``bench/faults.py`` runs them and prints the counts."""
