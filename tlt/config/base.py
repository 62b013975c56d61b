"""The base of every config section: unknown keys are refused, assignments are validated."""
from pydantic import BaseModel, ConfigDict


class Stage(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
