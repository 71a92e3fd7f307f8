"""The experiment language (pure): pipeline YAML → a validated, expanded plan of steps.

Used by the orchestrator (to create runs) and by `m27 plan` (without any service).
`load_pipeline` parses and checks a file, reporting every problem at once; `dag` holds the
graph functions, `shellquote` the quoting that keeps template values from becoming shell
syntax, `plan` the execution-plan view.
"""

from m27.pipeline._spec import MAX_PIPELINE_BYTES, PipelineSpec, load_pipeline
from m27.pipeline._yaml import PipelineError, Problem

__all__ = ["MAX_PIPELINE_BYTES", "PipelineError", "PipelineSpec", "Problem", "load_pipeline"]
