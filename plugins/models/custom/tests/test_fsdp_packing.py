"""Under FSDP2 the native model derives a packing's sample boundaries once per forward, not
once per block: FSDP rebuilds dataclass inputs before every wrapped block, so what kernels
derive from a packing lives in its ``cache`` field (an attribute set on it would be lost, and
each layer would pay a host sync for it again)."""

from types import SimpleNamespace

import pytest
import torch

from prime_core.trainer.packing import Packing


@pytest.fixture
def one_process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_boundaries_once_per_forward_under_fsdp(tmp_path, one_process_group, monkeypatch):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from prime_plugin_custom.build import build
    from prime_plugin_custom.tiny import save_tiny

    folder = save_tiny(tmp_path / "qwen3", "Qwen3ForCausalLM")
    model = build(SimpleNamespace(name=str(folder), dtype="float32", attn="sdpa", trust_remote_code=False))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    assert len(model.model.layers) >= 2
    reads, segments = [], Packing.segments

    def counted(self):
        if self.starts is None and "starts" not in self.cache:  # read from the device
            reads.append(self)
        return segments(self)

    monkeypatch.setattr(Packing, "segments", counted)
    positions = torch.cat([torch.arange(5), torch.arange(11)])[None]
    ids = torch.randint(0, 100, positions.shape, generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, position_ids=positions).logits.float().sum().backward()
    assert len(reads) == 1, f"sample boundaries read from the device {len(reads)} times in one forward and backward"
    # The trainer's rows carry the starts from the host: nothing is read.
    packing = Packing.from_position_ids(positions)
    packing.starts = (0, 5)
    model(input_ids=ids, position_ids=positions, packing=packing).logits.float().sum().backward()
    assert len(reads) == 1
