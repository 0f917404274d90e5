"""The torch APIs livemig rests on beyond torch's public, stable surface, pinned on the torch
this suite runs on (CI: the full suite on 2.14.1, these and one FSDP2 kill on 2.13.0 through
scripts/check_torch.sh; 2.11 and 2.15 by hand, docs/development.md). A torch that drops or
changes one fails here with the API's name, not somewhere deep inside a recovery.

How they behave under a real generation swap is tested in test_torch_group.py; here only
that each exists with the shape livemig calls it with."""

from __future__ import annotations

import inspect
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from livemig.comm import communicator, torch_group


def _version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def test_the_installed_torch_is_in_the_range_livemig_admits():
    assert (2, 11) <= _version() < (2, 16), f"torch {torch.__version__} is outside >=2.11,<2.16 (pyproject.toml)"


def test_gloo_options_take_a_timeout_and_a_device_on_a_named_host():
    """comm/group.py `_gloo`: a group bound to the --host address ($LIVEMIG_HOST)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=3)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, opts)
    t = torch.ones(4)
    pg.allreduce([t]).wait()
    assert torch.equal(t, torch.ones(4))


def test_gloo_keeps_the_base_collectives_fsdp2_is_delegated_to():
    """comm/torch_group.py: FSDP2's all_gather_single / reduce_scatter_single go to these."""
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=3))
    out, inp = torch.empty(4), torch.arange(4.0)
    pg._allgather_base(out, inp).wait()
    assert torch.equal(out, inp)
    o = dist.ReduceScatterOptions()
    o.reduceOp = dist.ReduceOp.SUM
    out2 = torch.empty(4)
    pg._reduce_scatter_base(out2, inp, o).wait()
    assert torch.equal(out2, inp)


def test_a_python_work_subclass_and_the_extended_backend_registration_exist():
    """comm/torch_group.py: `_GuardedWork(dist._Work)` and `register_backend(..., extended_api=True,
    devices=[...])`, and `distributed_c10d._get_default_group` that install() reads."""
    assert issubclass(torch_group._GuardedWork, dist._Work)
    params = inspect.signature(dist.Backend.register_backend).parameters
    assert "extended_api" in params and "devices" in params
    assert callable(dist.distributed_c10d._get_default_group)


@pytest.mark.skipif(_version() < (2, 14), reason=f"torch {torch.__version__} has no reconfigure API (2.14 and later)")
def test_the_reconfigure_api_has_the_shape_livemig_calls():
    """comm/group.py's reconfigure communicator: `_Options.enable_reconfigure`, a handle per
    process, `ReconfigureOptions(uuid, handles, timeout)` and `ProcessGroupGloo.reconfigure`.
    A group of one re-forms with its own handle, and its rank is the handle's position."""
    assert communicator.reconfigure_available()
    assert "enable_reconfigure" in inspect.signature(dist.init_process_group).parameters
    assert callable(dist.distributed_c10d._reconfigure) and callable(dist.distributed_c10d._get_reconfigure_handle)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=3)
    opts.enable_reconfigure = True
    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    pg = dist.ProcessGroupGloo(store, 0, 1, opts)
    assert pg.supports_reconfigure
    ro = dist.distributed_c10d.ReconfigureOptions()
    ro.uuid, ro.handles, ro.timeout = 1, [pg.get_reconfigure_handle()], timedelta(seconds=5)
    pg.reconfigure(ro).wait()
    t = torch.full((3,), 2.0)
    pg.allreduce([t]).wait()
    assert torch.equal(t, torch.full((3,), 2.0)) and pg.rank() == 0 and pg.size() == 1


def test_reconfigure_is_reported_absent_on_a_torch_without_it():
    assert communicator.reconfigure_available() == (_version() >= (2, 14))


def test_a_submission_error_is_told_apart_from_a_lost_link():
    """comm/torch_group.py: an op the backend lacks or a wrong call reaches the caller as itself
    (the group goes on); what a lost peer or a timeout says poisons the generation (a recovery)."""
    from livemig.comm.torch_group import is_link_failure

    assert not is_link_failure(RuntimeError("Backend gloo does not support alltoall"))
    assert not is_link_failure(ValueError("Cannot use ReduceOp.AVG with Gloo"))
    assert not is_link_failure(RuntimeError("Tensors must be contiguous"))
    assert is_link_failure(RuntimeError("[gloo/transport/tcp/pair.cc:545] Read error: Connection reset by peer"))
    assert is_link_failure(RuntimeError("Connection closed by peer [127.0.0.1]:30095"))
    assert is_link_failure(RuntimeError("Timed out waiting 30000ms for recv operation to complete"))
