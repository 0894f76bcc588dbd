"""Storage failures (a full disk, a file-size limit) are recognised through the errors
that wrap them, and the run's files are replaced whole or not at all: on a full disk the
old ones stay. The end-to-end runs (start-up, a save under `ulimit -f`, data
preparation) are in test_train.py and test_data.py."""
import errno
import json

import pytest

from jaxptd.runtime import runlog, storage
from jaxptd.config import load_config


def test_storage_failures_are_recognised_through_their_causes():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("the save failed") from e
    except RuntimeError as e:
        assert storage.write_failure(e).reason == "no space left on device"
    tensorstore = ValueError('OUT_OF_RANGE: Error writing "x": Failed to write 45169 bytes '
                             "to file 21: File too large [os_error_code='27']")
    failure = storage.write_failure(tensorstore)
    assert failure.remedy == "raise the file-size limit (ulimit -f)" and not failure.space
    assert storage.write_failure(OSError(errno.ENOENT, "No such file")) is None
    assert storage.write_failure(ValueError("a bug")) is None


def test_run_files_keep_their_content_on_a_full_disk(small_disk):
    """config.yaml and metrics.jsonl are replaced whole or not at all: on a full disk the
    old ones stay (not truncated to 0 bytes, as a plain rewrite leaves them) and the
    failure is one StorageError line naming the file and what to do."""
    config = load_config(None, [f"train.run_dir={small_disk}"])
    runlog.write_config(str(small_disk), config, 0)
    records = "".join(json.dumps({"step": s, "loss": 2.0}) + "\n" for s in range(1, 50))
    (small_disk / "metrics.jsonl").write_text(records)
    kept = {str(p.relative_to(small_disk)): p.read_bytes() for p in small_disk.rglob("*")
            if p.is_file()}
    with open(small_disk / "filler", "wb", buffering=0) as f:
        with pytest.raises(OSError):
            while True:
                f.write(bytes(1 << 16))
    with pytest.raises(storage.StorageError, match=r"config.yaml: no space left on device "
                                                   r"while writing the run's config; free"):
        runlog.write_config(str(small_disk), load_config(None, ["train.steps=7"]), 0)
    with pytest.raises(storage.StorageError, match="metrics.jsonl: no space left"):
        runlog.MetricsLog(config, 20, lead=True)
    assert {str(p.relative_to(small_disk)): p.read_bytes() for p in small_disk.rglob("*")
            if p.is_file() and p.name != "filler"} == kept
