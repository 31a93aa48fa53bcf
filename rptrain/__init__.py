"""rptrain: dispatch-pipeline training for models whose training state does not fit on the GPU."""
