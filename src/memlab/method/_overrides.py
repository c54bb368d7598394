"""Model-group overrides of an extra model (a GKD teacher, an online method's reward models):
the checks that they name options of the run's model group and that the group, with them
applied, is valid.

Not an option of its own.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memlab.context import BuildContext


def override_key_errors(ctx: BuildContext, overrides: dict[str, Any], where: str) -> list[str]:
    """Keys of ``overrides`` (model-group overrides: a teacher, a reward model) that the run's
    model group does not have, one error each, named ``<where>.<key>``."""
    if not dataclasses.is_dataclass(ctx.model):
        return []
    fields_ = {f.name for f in dataclasses.fields(ctx.model)}
    return [f"{where}.{key}: not an option of model={ctx.model.name} (options: "
            f"{', '.join(sorted(fields_))})" for key in overrides if key not in fields_]


def overridden_model_errors(ctx: BuildContext, overrides: dict[str, Any], where: str) -> list[str]:
    """The model group's own validation of itself with ``overrides`` applied (keys known)."""
    if not dataclasses.is_dataclass(ctx.model):
        return []
    model = dataclasses.replace(ctx.model, **overrides)
    return [f"{where}: {e}" for e in model.validate(ctx)]
