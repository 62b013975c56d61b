"""The bodies of a run's stages, one small module each: plain functions over the parts
tlt.build made, which return summaries (tlt.summaries) and log to the run's tracker.
tlt.pipeline.Pipeline calls them; the Prefect tasks (tasks/stages.py) call the pipeline."""
