"""The process group behind a ``group=`` / ``process_group=`` argument: a ``torch.distributed`` process group, or a
one-dimensional ``DeviceMesh`` (a mesh of its own, or a named dimension of a larger one, ``mesh["cp"]``) as
torchtitan and FSDP2 compose them."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["resolve_group"]


def resolve_group(group: object, *, argument: str = "group") -> dist.ProcessGroup | None:
    """The ``torch.distributed`` process group that ``group`` names.

    Args:
        group: None (the default group), a ``torch.distributed.ProcessGroup`` (``dist.group.WORLD`` included), or a
            1-D ``torch.distributed.device_mesh.DeviceMesh``: a mesh's named dimension (``mesh["cp"]``) or a mesh of
            one dimension.
        argument: the argument's name, for the error messages.

    Returns:
        None for None or ``dist.group.WORLD``; otherwise the process group (a mesh dimension's own group).

    Raises:
        ValueError: a DeviceMesh of more than one dimension (the message names its dimensions and their sizes).
        TypeError: anything else.
    """
    if group is None or group is dist.group.WORLD:
        return None
    if isinstance(group, dist.ProcessGroup):
        return group
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            names = group.mesh_dim_names or tuple(f"dim {n}" for n in range(group.ndim))
            dims = ", ".join(f"{name}={size}" for name, size in zip(names, group.mesh.shape))
            raise ValueError(
                f"{argument} takes a 1-D DeviceMesh (the dimension whose ranks hold one sequence's shards, e.g. "
                f"mesh['cp']); got a {group.ndim}-D mesh ({dims})"
            )
        return group.get_group()
    raise TypeError(
        f"{argument} must be None, a torch.distributed ProcessGroup or a 1-D DeviceMesh, got {type(group).__name__}"
    )
