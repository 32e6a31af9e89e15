"""The sandboxes' parent cgroup: its weight per cgroup version and driver, and the errors a user sees."""

import pytest

from infra.sandbox.cpu_weight import PARENT, sandbox_parent, shares_to_weight


def test_shares_convert_to_v2_weight_as_the_kernel_scales_them():
    # the v1 and v2 defaults weigh the same (1024 <-> 100); the ends clamp to v2's range
    assert [shares_to_weight(s) for s in (2, 128, 1024, 2048, 262144)] == [1, 13, 100, 200, 10000]


def test_cgroupfs_v1_writes_cpu_shares_under_the_cpu_controller(tmp_path):
    (tmp_path / "cpu").mkdir()
    assert sandbox_parent(128, "cgroupfs", "1", root=tmp_path) == f"/{PARENT}"
    assert (tmp_path / "cpu" / PARENT / "cpu.shares").read_text() == "128"
    assert sandbox_parent(256, "cgroupfs", "1", root=tmp_path) == f"/{PARENT}"  # re-weighs the existing parent
    assert (tmp_path / "cpu" / PARENT / "cpu.shares").read_text() == "256"


def test_cgroupfs_v2_writes_the_converted_weight(tmp_path):
    sandbox_parent(1024, "cgroupfs", "2", root=tmp_path)
    assert (tmp_path / PARENT / "cpu.weight").read_text() == "100"


def test_an_unwritable_cgroup_names_the_file_and_the_setting(tmp_path):
    with pytest.raises(RuntimeError, match=r"tasks.sandbox_cpu_shares: cannot write 128 to .*cpu.shares"):
        sandbox_parent(128, "cgroupfs", "1", root=tmp_path / "absent")


@pytest.mark.parametrize("shares", [0, 1, 262145])
def test_out_of_range_shares_are_refused(shares, tmp_path):
    with pytest.raises(ValueError, match="2..262144"):
        sandbox_parent(shares, "cgroupfs", "1", root=tmp_path)


def test_an_unknown_driver_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown cgroup driver 'foo'"):
        sandbox_parent(128, "foo", "2", root=tmp_path)
