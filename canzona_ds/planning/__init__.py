"""Pure planning: shapes -> plans.  No torch.distributed, no DeepSpeed."""
from .params import ParamSpec, default_is_matrix, specs_from_named_shapes
from .dp import OwnershipPlan, plan_dp

__all__ = ["ParamSpec", "OwnershipPlan", "default_is_matrix", "plan_dp", "specs_from_named_shapes"]
