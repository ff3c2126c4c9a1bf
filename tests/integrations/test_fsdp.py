"""memguard.integrations.fsdp.apply: FSDP2 sharding as a plan says, on a 1-rank gloo group in this process."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

from memguard.errors import ConfigError
from memguard.estimator._result import Estimate
from memguard.planner._plan import Plan

fsdp = pytest.importorskip("memguard.integrations.fsdp")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).mean()


def _plan(**kw) -> Plan:
    fields = dict(micro_batch_size=2, grad_accum_steps=1, world_size=1, global_batch_size=2, precision="32-true",
                  activation_checkpointing=False, zero_stage=3, budget_bytes=1 << 30, device="cpu",
                  strategy="fsdp2")
    fields.update(kw)
    est = Estimate(peak_bytes=1 << 20, breakdown={"params": 1 << 20}, context_bytes=0, peak_phase="backward",
                   allocated_peak_bytes=1 << 20, device="cpu", precision=fields["precision"],
                   zero_stage=fields["zero_stage"], world_size=fields["world_size"], gpu=None,
                   micro_batch_size=fields["micro_batch_size"])
    return Plan(estimate=est, **fields)


@pytest.fixture
def group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_without_a_process_group_every_problem_is_listed() -> None:
    assert not dist.is_initialized()
    with pytest.raises(fsdp.FSDPSetupError) as err:
        fsdp.apply(Net(), _plan(zero_stage=0, strategy="ddp"))
    problems = err.value.problems
    # both problems at once: the un-sharded plan and the missing process group
    assert len(problems) == 2 and "ZeRO stage 0" in problems[0] and "init_process_group" in problems[1]
    assert isinstance(err.value, ConfigError)


@pytest.mark.parametrize("stage, reshard", [(3, True), (2, False), (1, False)])  # the agreed FSDP2 meaning
def test_blocks_then_root_with_the_plans_resharding(group, stage: int, reshard: bool) -> None:
    from torch.distributed.fsdp import FSDPModule

    model = fsdp.apply(Net(), _plan(zero_stage=stage))
    assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in model.blocks)
    assert not isinstance(model.head, FSDPModule)  # the head belongs to the root's group
    groups = [b._get_fsdp_state()._fsdp_param_groups[0] for b in model.blocks]
    # FSDPParamGroup.post_forward_mesh_info is None exactly when reshard_after_forward is False
    assert all((g.post_forward_mesh_info is not None) == reshard for g in groups)
    model(torch.randn(4, 8)).backward()  # it trains


def test_bf16_mixed_is_a_mixed_precision_policy_with_fp32_reduction(group) -> None:
    model = fsdp.apply(Net(), _plan(precision="bf16-mixed", activation_checkpointing=True, checkpoint_blocks=2))
    mp = model.blocks[0]._get_fsdp_state()._mp_policy
    assert mp.param_dtype == torch.bfloat16 and mp.reduce_dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the sharded master weights stay fp32
    # the first two blocks are checkpointed (before sharding), the third is not
    assert [getattr(b, "_memguard_checkpointed", False) for b in model.blocks] == [True, True, False]
    model(torch.randn(4, 8)).float().backward()


def test_user_mistakes_are_listed_together(group) -> None:
    sharded = fsdp.apply(Net(), _plan())
    plan = _plan(world_size=2, global_batch_size=4)
    object.__setattr__(plan, "strategy", "deepspeed")  # Plan.strategy, as the planner records it
    with pytest.raises(fsdp.FSDPSetupError) as err:
        fsdp.apply(sharded, plan)
    text = "\n".join(err.value.problems)
    assert "already sharded" in text and "DeepSpeed" in text and "made for 2 ranks but the mesh has 1" in text
