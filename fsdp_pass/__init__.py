"""fsdp_pass: Fully Sharded Data Parallel (ZeRO-2 / ZeRO-3) as a trace pass for Lightning Thunder."""

from importlib import metadata as _metadata
from pathlib import Path as _Path

try:
    import tomllib as _tomllib
except ImportError:  # Python 3.10: no tomllib; the version then says unknown
    _tomllib = None

_DISTRIBUTION = "fsdp-pass"


def _version() -> str:
    """This package's version:

    1. what the installed distribution's metadata says (a wheel, or an editable install of this tree);
    2. else, in a source tree that was never installed, ``pyproject.toml``'s version next to the package, with
       ``+source`` appended;
    3. else ``0+unknown``.
    """
    try:
        return _metadata.version(_DISTRIBUTION)
    except _metadata.PackageNotFoundError:
        pass
    try:
        pyproject = _Path(__file__).resolve().parent.parent / "pyproject.toml"
        return _tomllib.loads(pyproject.read_text())["project"]["version"] + "+source"
    except (AttributeError, OSError, KeyError, ValueError):
        return "0+unknown"


__version__ = _version()

from fsdp_pass.shard import gloo_exit as _gloo_exit

# At exit, wait until gloo's worker threads are idle (a rank aborted otherwise: see the module). Registered before the
# rest is imported (it needs the standard library alone), so that the exit hooks of what it imports run before it.
_gloo_exit.install()

from fsdp_pass.api import explain, fsdp_of, full_state_dict, load_full_state_dict, no_sync, predict_step
from fsdp_pass.errors import FSDPError
from fsdp_pass.ops.finite_checks import NonFiniteError
from fsdp_pass.plan.layout import ShardLayout
from fsdp_pass.plan.mixed_precision import MixedPrecision
from fsdp_pass.plan.schedule import Schedule
from fsdp_pass.plan.sharding import ShardingPlan, Strategy
from fsdp_pass.plan.unit_policies import Blocks, BySize, Groups, PerParameter
from fsdp_pass.plan.units import Unit, UnitPlan
from fsdp_pass.report.explain import Explanation
from fsdp_pass.shard.groups import fake_process_group
from fsdp_pass.train.distributed_checkpoint import CheckpointWarning, Resumed, load_checkpoint, save_checkpoint
from fsdp_pass.train.grad_norm import GradNorms, clip_grad_norm_, grad_norms
from fsdp_pass.train.grad_scaler import GradScaler
from fsdp_pass.train.state_dicts import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from fsdp_pass.transform import FSDP

__all__ = [
    "FSDP",
    "Blocks",
    "BySize",
    "CheckpointWarning",
    "Explanation",
    "FSDPError",
    "GradNorms",
    "GradScaler",
    "Groups",
    "MixedPrecision",
    "NonFiniteError",
    "PerParameter",
    "Resumed",
    "Schedule",
    "ShardLayout",
    "ShardingPlan",
    "Strategy",
    "Unit",
    "UnitPlan",
    "clip_grad_norm_",
    "explain",
    "fake_process_group",
    "fsdp_of",
    "full_state_dict",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "grad_norms",
    "load_checkpoint",
    "load_full_state_dict",
    "no_sync",
    "predict_step",
    "save_checkpoint",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]

# last, once every name above exists: the executor that runs the pass's ops registers itself with Thunder
# (fsdp_pass_executors imports fsdp_pass's op definitions, so it comes after them)
import fsdp_pass_executors  # noqa: E402, F401
