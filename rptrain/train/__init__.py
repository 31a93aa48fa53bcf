"""The training library behind the rptrain CLI."""
