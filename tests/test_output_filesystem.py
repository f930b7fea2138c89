"""Which filesystem holds the output, and how the `db` format writes there (writers.filesystem)."""
import json
import logging
import subprocess

import pytest

from writer_helpers import monitored
from trainmon.config.settings import ConfigError, load_config
from trainmon.writers import filesystem
from trainmon.writers.filesystem import DB_PATH, LOCAL, NETWORK, STREAM_PATH

# statfs magic -> (name, kind, write path)
KINDS = {
    0x6969: ("nfs", NETWORK, STREAM_PATH),
    0x0BD00BD0: ("lustre", NETWORK, STREAM_PATH),
    0x47504653: ("gpfs", NETWORK, STREAM_PATH),
    0xFF534D42: ("cifs", NETWORK, STREAM_PATH),
    0xFE534D42: ("smb2", NETWORK, STREAM_PATH),
    0x65735546: ("fuse", NETWORK, STREAM_PATH),
    0x00C36400: ("ceph", NETWORK, STREAM_PATH),
    0x19830326: ("beegfs", NETWORK, STREAM_PATH),
    0x794C7630: ("overlay", LOCAL, DB_PATH),
    0xEF53: ("ext4", LOCAL, DB_PATH),
    0x58465342: ("xfs", LOCAL, DB_PATH),
    0x01021994: ("tmpfs", LOCAL, DB_PATH),
    0x12345678: ("unknown", LOCAL, DB_PATH),  # a filesystem we do not know: the local default
}
NO_MOUNTS = ""


@pytest.mark.parametrize("magic", KINDS, ids=[name for name, _, _ in KINDS.values()])
def test_each_statfs_magic_gives_its_kind_and_write_path(tmp_path, magic):
    seen = []

    def statfs(path):
        seen.append(path)
        return magic

    choice = filesystem.choose(tmp_path / "run" / "rank_0", statfs=statfs, mountinfo=NO_MOUNTS)
    assert (choice.fstype, choice.kind, choice.write_path) == KINDS[magic]
    assert seen and all(p == str(tmp_path.resolve()) for p in seen), "asked about the nearest existing directory"
    assert choice.fstype in choice.reason


MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
60 27 0:50 / /scratch rw,relatime - lustre 10.0.0.1@tcp:/fs rw
61 27 0:51 / /scratch/home rw,relatime - nfs4 server:/home rw
62 27 0:52 / /mnt/bucket rw,nosuid - fuse.gcsfuse bucket rw
63 27 0:53 / /gpfs\\040data rw - gpfs gpfs0 rw
"""


@pytest.mark.parametrize("path, fstype, kind", [
    ("/scratch/run/rank_0", "lustre", NETWORK),
    ("/scratch/home/me/out", "nfs4", NETWORK),  # the longest mount point wins
    ("/scratchy/out", "ext4", LOCAL),  # a prefix of the name is not a mount point
    ("/mnt/bucket/out", "fuse.gcsfuse", NETWORK),
    ("/gpfs data/x", "gpfs", NETWORK),
    ("/home/me", "ext4", LOCAL),
])
def test_without_statfs_the_longest_mount_point_of_mountinfo_decides(path, fstype, kind):
    assert filesystem.mountinfo_fstype(path, MOUNTINFO) == fstype
    choice = filesystem.choose(path, statfs=lambda p: None, mountinfo=MOUNTINFO)
    assert (choice.fstype, choice.kind) == (fstype, kind)


def test_a_fuse_mount_is_named_by_mountinfo():
    choice = filesystem.choose("/mnt/bucket/out", statfs=lambda p: 0x65735546, mountinfo=MOUNTINFO)
    assert (choice.fstype, choice.kind, choice.write_path) == ("fuse.gcsfuse", NETWORK, STREAM_PATH)


@pytest.mark.parametrize("setting, kind, path", [("local", LOCAL, DB_PATH), ("network", NETWORK, STREAM_PATH)])
def test_the_config_forces_the_path_whatever_the_filesystem(tmp_path, setting, kind, path):
    for magic in (0x6969, 0xEF53):
        choice = filesystem.choose(tmp_path, setting, statfs=lambda p: magic, mountinfo=NO_MOUNTS)
        assert (choice.kind, choice.write_path) == (kind, path)
        assert "output_filesystem" in choice.reason


def test_statfs_through_libc_reads_the_real_magic(tmp_path):
    expected = int(subprocess.run(["stat", "-f", "-c", "%t", str(tmp_path)], capture_output=True, text=True,
                                  check=True).stdout, 16)
    assert filesystem.statfs_magic(str(tmp_path)) == expected


def test_a_bad_output_filesystem_is_a_config_error():
    with pytest.raises(ConfigError, match="output_filesystem"):
        load_config({"output_filesystem": "lustre"})


def test_run_json_records_the_choice_and_one_line_says_it(output_dir, write_config, caplog):
    with caplog.at_level(logging.INFO, logger="trainmon"):
        monitor, _ = monitored(write_config, steps=2, format=["db"], output_filesystem="network")
    meta = json.loads((monitor.output_dir / "run.json").read_text())
    assert meta["output_filesystem"]["write_path"] == STREAM_PATH
    assert meta["output_filesystem"]["fstype"] == filesystem.filesystem_name(output_dir)
    assert (monitor.output_dir / "records.stream").is_file() and not (monitor.output_dir / "monitor.db").exists()
    lines = [r.getMessage() for r in caplog.records if "the db format writes" in r.getMessage()]
    assert len(lines) == 1 and "records.stream" in lines[0] and "because output_filesystem is" in lines[0], lines


def test_auto_on_a_local_disk_writes_the_database(output_dir, write_config):
    monitor, _ = monitored(write_config, steps=1, format=["db"])
    meta = json.loads((monitor.output_dir / "run.json").read_text())
    assert meta["output_filesystem"]["kind"] == LOCAL, "the tests run on a local disk"
    assert (monitor.output_dir / "monitor.db").is_file() and not (monitor.output_dir / "records.stream").exists()
