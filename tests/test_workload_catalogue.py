"""Submit-time validation of the built-in workloads: bad parameters fail here, with one clear line."""

from __future__ import annotations

import gzip

import pytest

from gpuq.service.errors import InvalidSpec
from gpuq.service.workloads import CATALOGUE, get_workload, parse_args

IDX = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
       "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def validate(name: str, args: list[str], gpus: int = 1) -> dict:
    w = get_workload(name)
    return w.validate(parse_args(w, args), gpus)


def test_catalogue_holds_every_built_in_workload():
    assert {"matmul", "device-info", "norm-log", "multi-matmul", "copy", "train"} <= set(CATALOGUE)
    for w in CATALOGUE.values():
        assert w.entry.startswith("gpuq.workers.workloads.") and ":" in w.entry


def test_the_clients_list_of_workload_names_is_the_catalogues():
    # The client tells a workload from a script or a program by it (cli/script.py), and a name
    # with a '.' or a '/' would be a path.
    from gpuq.service.constants import WORKLOAD_NAMES

    assert WORKLOAD_NAMES == set(CATALOGUE)
    assert not any("." in name or "/" in name for name in WORKLOAD_NAMES)


def test_defaults_are_valid_on_the_gpu_counts_each_workload_allows():
    assert validate("device-info", [], gpus=3) == {}
    assert validate("norm-log", [])["steps"] == 1000
    assert validate("norm-log", [])["size"] == 100
    assert validate("multi-matmul", [], gpus=2)["size"] == 2048
    assert validate("copy", [], gpus=2)["mib"] == 256
    train = validate("train", [])
    assert train["model"] == "lenet" and train["strategy"] == "single" and train["data_dir"] == ""


def test_train_parses_its_flags():
    p = validate("train", ["--model", "resnet18", "--epochs", "2", "--batch-size", "512",
                           "--lr", "0.2", "--strategy", "ddp", "--train-size", "100"], gpus=2)
    assert (p["model"], p["epochs"], p["batch_size"], p["lr"], p["strategy"]) == \
        ("resnet18", 2, 512, 0.2, "ddp")


@pytest.mark.parametrize("name, args, gpus, message", [
    ("train", ["--model", "vgg"], 1, "--model must be one of lenet, resnet18"),
    ("train", ["--batch-size", "0"], 1, "--batch-size must be at least 1"),
    ("train", ["--lr", "0"], 1, "--lr must be greater than 0"),
    ("train", ["--strategy", "ddp"], 1, "give --gpus 2 or more"),
    ("train", ["--strategy", "manual"], 1, "give --gpus 2 or more"),
    ("train", ["--strategy", "dp"], 1, "give --gpus 2 or more"),
    ("train", [], 2, "--strategy single trains on one GPU"),
    ("train", ["--strategy", "ddp", "--batch-size", "2"], 4, "--batch-size 2 is smaller than --gpus 4"),
    ("train", ["--strategy", "fsdp"], 2, "--strategy must be one of single, manual, dp, ddp"),
    ("train", ["--checkpoint", "/no/such/dir/ck.pt"], 1, "does not exist"),
    ("train", ["--epochs", "two"], 1, "--epochs must be a whole number"),
    ("multi-matmul", [], 1, "needs at least 2 GPUs"),
    ("multi-matmul", [], 3, "at most 2 GPUs"),
    ("norm-log", ["--steps", "0"], 1, "--steps must be at least 1"),
    ("copy", ["--mib", "-1"], 1, "--mib must be at least 1"),
    ("copy", ["--size", "4"], 1, "copy has no parameter --size"),
])
def test_bad_parameters_fail_at_submit_with_a_clear_message(name, args, gpus, message):
    with pytest.raises(InvalidSpec) as e:
        validate(name, args, gpus)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_data_dir_must_hold_the_four_idx_files_plain_or_gzipped(tmp_path):
    with pytest.raises(InvalidSpec, match="is not a directory"):
        validate("train", ["--data-dir", str(tmp_path / "nowhere")])
    (tmp_path / IDX[0]).write_bytes(b"")
    (tmp_path / (IDX[1] + ".gz")).write_bytes(gzip.compress(b""))
    with pytest.raises(InvalidSpec) as e:
        validate("train", ["--data-dir", str(tmp_path)])
    assert IDX[2] in str(e.value) and IDX[3] in str(e.value) and IDX[0] not in str(e.value)
    (tmp_path / IDX[2]).write_bytes(b"")
    (tmp_path / (IDX[3] + ".gz")).write_bytes(b"")
    assert validate("train", ["--data-dir", str(tmp_path)])["data_dir"] == str(tmp_path)


def test_the_catalogue_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, gpuq.service.workloads as w; w.get_workload('train'); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
