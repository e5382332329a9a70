"""Hostfile parsing, --include/--exclude resolution and the host name check (no processes)."""

import socket

import pytest

from zengine.launcher.hostfile import (
    HostfileError,
    check_hosts_resolve,
    parse_filter,
    parse_hostfile,
    parse_hostfile_lines,
    resolve_resources,
)

HOSTS = {"worker-0": 4, "worker-1": 4, "worker-2": 2}


def test_parse_hostfile_with_comments_and_blank_lines():
    text = """
    # the cluster
    worker-0 slots=4

    worker-1   slots=2   # trailing comment
    """
    assert parse_hostfile_lines(text.splitlines()) == {"worker-0": 4, "worker-1": 2}


def test_parse_hostfile_keeps_file_order():
    hosts = parse_hostfile_lines(["b slots=1", "a slots=2", "c slots=3"])
    assert list(hosts) == ["b", "a", "c"]


def test_duplicate_host_names_both_lines():
    with pytest.raises(
        HostfileError, match=r"hf, line 3: host 'a' is listed twice \(first on line 1\)"
    ):
        parse_hostfile_lines(["a slots=1", "b slots=1", "a slots=2"], source="hf")


@pytest.mark.parametrize(
    "line, message",
    [
        ("worker-0", "expected 'hostname slots=N'"),
        ("worker-0 4", "expected 'hostname slots=N'"),
        ("worker-0 slots=4 extra", "expected 'hostname slots=N'"),
        ("worker-0 slots=four", "slot count 'four' of host 'worker-0' is not an integer"),
        ("worker-0 slots=0", "has slots=0; it must be at least 1"),
    ],
)
def test_bad_line_is_named(line, message):
    with pytest.raises(HostfileError, match=r"hf, line 2: ") as err:
        parse_hostfile_lines(["ok slots=1", line], source="hf")
    assert message in str(err.value)


def test_host_starting_with_dash_is_refused_by_line():
    """A host that ssh or pdsh would read as an option (``-oProxyCommand=...`` runs a command) never gets there."""
    with pytest.raises(
        HostfileError, match=r"hf, line 3: host '-oProxyCommand=/tmp/x.sh' starts with '-'"
    ) as err:
        parse_hostfile_lines(
            ["ok slots=1", "# a comment", "-oProxyCommand=/tmp/x.sh slots=1"], source="hf"
        )
    assert "option" in str(err.value)
    with pytest.raises(HostfileError, match=r"hf, line 1: host '-p' starts with '-'"):
        parse_hostfile_lines(["-p slots=2"], source="hf")
    for option in ("--include", "--exclude"):
        with pytest.raises(
            HostfileError, match=rf"{option} 'a@-oProxyCommand=x:0': host '-oProxyCommand=x' starts"
        ):
            parse_filter("a@-oProxyCommand=x:0", option)


def test_parse_hostfile_from_disk(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("node-a slots=8\nnode-b slots=8\n")
    assert parse_hostfile(str(path)) == {"node-a": 8, "node-b": 8}


def test_missing_and_empty_hostfile(tmp_path):
    with pytest.raises(HostfileError, match="not found"):
        parse_hostfile(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(HostfileError, match="lists no hosts"):
        parse_hostfile(str(empty))


def test_parse_filter():
    assert parse_filter("a:0,2@b") == {"a": [0, 2], "b": None}
    assert parse_filter("a:1@a:0") == {"a": [1, 0]}
    assert parse_filter("a@a:0") == {"a": None}
    with pytest.raises(HostfileError, match="empty host name"):
        parse_filter("a@")
    with pytest.raises(HostfileError, match="slot 'x' of host 'a' is not an integer"):
        parse_filter("a:x")


def test_no_filter_gives_every_slot():
    assert resolve_resources(HOSTS) == {
        "worker-0": [0, 1, 2, 3],
        "worker-1": [0, 1, 2, 3],
        "worker-2": [0, 1],
    }


def test_include_slots_and_whole_hosts_in_hostfile_order():
    resolved = resolve_resources(HOSTS, include="worker-2@worker-0:3,1")
    assert resolved == {"worker-0": [1, 3], "worker-2": [0, 1]}
    assert list(resolved) == ["worker-0", "worker-2"]


def test_exclude_slots_and_whole_hosts():
    resolved = resolve_resources(HOSTS, exclude="worker-1@worker-0:0,2")
    assert resolved == {"worker-0": [1, 3], "worker-2": [0, 1]}


def test_exclude_every_slot_of_a_host_drops_it():
    assert resolve_resources(HOSTS, exclude="worker-2:0,1") == {
        "worker-0": [0, 1, 2, 3],
        "worker-1": [0, 1, 2, 3],
    }


def test_include_and_exclude_together_rejected():
    with pytest.raises(HostfileError, match="--include and --exclude cannot be used together"):
        resolve_resources(HOSTS, include="worker-0", exclude="worker-1")


def test_unknown_host_and_slot_rejected():
    with pytest.raises(HostfileError, match=r"--include: unknown host 'worker-9'"):
        resolve_resources(HOSTS, include="worker-9")
    with pytest.raises(
        HostfileError, match=r"--exclude: host 'worker-2' has no slot 2 \(it has slots 0..1\)"
    ):
        resolve_resources(HOSTS, exclude="worker-2:2")


def test_filter_leaving_nothing_rejected():
    with pytest.raises(HostfileError, match="leaves no slots"):
        resolve_resources({"a": 1}, exclude="a")


def getaddrinfo(host):
    return socket.getaddrinfo(host, None)


def test_hostfile_remembers_lines():
    hosts = parse_hostfile_lines(["# cluster", "a slots=1", "", "b slots=2"], source="hf")
    assert hosts == {"a": 1, "b": 2} and hosts.lines == {"a": 2, "b": 4}
    assert hosts.where("b") == "hf, line 4"


def test_unresolvable_hosts_are_named_with_their_lines():
    hosts = parse_hostfile_lines(
        [
            "localhost slots=1",
            "no-such-host.invalid slots=2",
            "127.0.0.1 slots=1",
            "::1 slots=1",
            "also-not.invalid slots=1",
        ],
        source="hf",
    )
    check_hosts_resolve(
        ["localhost", "127.0.0.1", "::1"], hosts, getaddrinfo
    )  # names and IP literals pass
    with pytest.raises(HostfileError) as err:
        check_hosts_resolve(list(hosts), hosts, getaddrinfo)
    message = str(err.value)
    assert "2 hosts of the job do not resolve" in message and "--exclude" in message, message
    assert "hf, line 2: host 'no-such-host.invalid' does not resolve (" in message, message
    assert "hf, line 5: host 'also-not.invalid' does not resolve (" in message, message
    assert "localhost'" not in message and "127.0.0.1" not in message, message


def test_resolution_checks_only_the_names_given():
    asked = []
    check_hosts_resolve(["b"], {"a": 1, "b": 1}, asked.append)
    assert asked == ["b"]
