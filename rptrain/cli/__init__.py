"""The rptrain command line (a thin Hydra entry point over rptrain.train)."""
