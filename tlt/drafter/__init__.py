"""EAGLE-3 drafter: model (export-compatible), online buffer, and trainer."""
from tlt.drafter.model import Eagle3Drafter, build_drafter, default_aux_ids

__all__ = ["Eagle3Drafter", "build_drafter", "default_aux_ids"]
