"""Hydra configs of the rptrain CLI, installed as the package ``rptrain.conf``.

pyproject.toml maps this folder into the package so that ``pkg://rptrain.conf`` finds it
after any kind of install, from any working directory.
"""
