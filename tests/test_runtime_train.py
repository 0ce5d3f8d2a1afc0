"""``train`` runs real epochs through the pipeline and evaluates on the whole test set."""

from __future__ import annotations

import pytest

from tapp_core.plan.plan import Plan
from tapp_core.platform.cluster import parse_cluster
from tapp_core.runtime import OptimizerConfig, train

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(180)]


def test_training_evaluates_every_test_sample_once_even_with_a_partial_last_batch() -> None:
    cluster = parse_cluster(
        {
            "name": "train3",
            "emulated": False,
            "devices": [{"name": f"d{i}", "memory": "2GiB"} for i in range(3)],
            "links": {"bandwidth": "1Gbit/s", "latency": "0us"},
        }
    )
    # 24-sample batches: the 512 synthetic test images end in a batch of 8, padded with ignored samples.
    plan = Plan("tiny_cnn", 24, 2, "1f1b", (0, 0, 0, 1, 1, 1, 1), (("d0",), ("d1", "d2")))
    result = train(
        plan,
        cluster,
        dataset="synthetic",
        epochs=2,
        steps_per_epoch=6,
        optimizer=OptimizerConfig(lr=0.05, momentum=0.9),
    )
    assert result.ok, result.error
    assert result.synthetic and result.dataset == "synthetic"
    assert result.test_samples == 512
    assert len(result.epoch_losses) == 2 and len(result.epoch_test_accuracy) == 2
    assert 0.0 <= result.test_accuracy <= 1.0
    # Synthetic classes are separable patterns: a few steps already beat chance (10%).
    assert result.test_accuracy > 0.2
    assert result.epoch_losses[1] < result.epoch_losses[0]


def test_training_on_a_missing_dataset_fails_with_its_name() -> None:
    cluster = parse_cluster(
        {
            "name": "one",
            "emulated": False,
            "devices": [{"name": "d0", "memory": "2GiB"}],
            "links": {"bandwidth": "1Gbit/s", "latency": "0us"},
        }
    )
    plan = Plan("mlp", 16, 1, "gpipe", (0,) * 6, (("d0",),))
    result = train(plan, cluster, dataset="cifar10", data_dir="/nonexistent/cifar", epochs=1)
    assert not result.ok
    assert "/nonexistent/cifar" in (result.error or "")
