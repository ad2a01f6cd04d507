"""The data-parallel strategies make the same update a single device makes on the same batch."""

from __future__ import annotations

import pytest
import torch

from gpuq.workers.workloads import data, nets, parallel

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def global_batch(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    train, _ = data.synthetic(0, n, 1)
    return next(data.batches(train, n))


def after_steps(strategy: str, devices: list[torch.device], steps: int = 1,
                net: str = "lenet") -> tuple[dict[str, torch.Tensor], parallel.Single]:
    torch.manual_seed(0)
    trainer = parallel.make(strategy, nets.build(net), devices, lr=0.5)
    x, y = global_batch()
    for _ in range(steps):
        trainer.step(x, y)
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, trainer


def assert_same_parameters(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("strategy", ["manual", "dp"])
def test_two_device_step_equals_the_single_device_step(strategy):
    torch.manual_seed(0)
    initial = nets.build("lenet").state_dict()
    single, _ = after_steps("single", [CPU], steps=2)
    split, trainer = after_steps(strategy, [CPU, CPU], steps=2)
    assert not torch.equal(single["fc2.weight"], initial["fc2.weight"])  # it did learn something
    assert_same_parameters(single, split)
    if strategy == "manual":
        for replica in trainer.replicas[1:]:
            assert_same_parameters(split, replica.state_dict())


def test_manual_step_with_an_uneven_split_still_matches():
    torch.manual_seed(0)
    x, y = global_batch(7)
    results = []
    for strategy, devices in (("single", [CPU]), ("manual", [CPU, CPU, CPU])):
        torch.manual_seed(0)
        t = parallel.make(strategy, nets.build("lenet"), devices, lr=0.5)
        loss, correct = t.step(x, y)
        results.append((t.model.state_dict(), loss.item(), correct.item()))
    assert_same_parameters(results[0][0], results[1][0])
    assert results[0][1] == pytest.approx(results[1][1], rel=1e-5)
    assert results[0][2] == results[1][2]


def test_allreduce_sums_into_every_tensor_even_on_one_device():
    tensors = [torch.ones(2, 3) * (i + 1) for i in range(3)]
    parallel.allreduce(tensors)
    for t in tensors:
        assert torch.equal(t, torch.full((2, 3), 6.0))


@pytest.mark.timeout(60)
def test_resnet18_trains_a_manual_step_and_keeps_replicas_in_step():
    params, trainer = after_steps("manual", [CPU, CPU], net="resnet18")
    assert trainer.model(global_batch(2)[0]).shape == (2, 10)
    assert_same_parameters(params, trainer.replicas[1].state_dict())


def test_checkpoint_state_of_one_strategy_loads_into_another():
    params, trainer = after_steps("dp", [CPU, CPU])
    other = parallel.make("manual", nets.build("lenet"), [CPU, CPU], lr=0.5)
    other.load(trainer.state())
    assert_same_parameters(params, other.replicas[1].state_dict())
