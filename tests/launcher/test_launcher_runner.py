"""Launch planning, torchrun/ssh command construction and input errors (no processes started)."""

import argparse
import re
import shlex
import socket

import subprocess

import pytest

from zengine.launcher import remote, runner
from zengine.launcher.args import add_config_arguments
from zengine.launcher.entry import target_argv
from zengine.launcher.environment import exported_env, read_env_file, worker_env
from zengine.launcher.options import LaunchError, build_parser, check_args
from zengine.launcher.plan import LaunchPlan, NodePlan, plan_launch, torchrun_argv
from zengine.launcher.remote import pdsh_command, resolve_for_ssh, ssh_command
from zengine.launcher.runner import main

HOSTS = {"worker-0": 4, "worker-1": 4, "worker-2": 2}


def parse(*argv):
    return build_parser().parse_args(list(argv))


def slots(plan):
    return {node.host: list(node.slots) for node in plan.nodes}


# --- options -----------------------------------------------------------------


def test_script_args_are_left_untouched():
    args = parse("--num_procs", "2", "train.py", "--num_gpus", "7", "--", "-x", "--local_rank=9")
    assert args.num_gpus == 2
    assert args.user_script == "train.py"
    assert args.user_args == ["--num_gpus", "7", "--", "-x", "--local_rank=9"]


def test_defaults():
    args = parse("train.py")
    assert (args.master_port, args.max_restarts, args.master_addr) == (29500, 0, None)
    assert (args.num_gpus, args.num_nodes, args.node_rank) == (None, None, None)
    assert args.no_local_rank is False and args.user_args == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num_gpus", "0"], "--num_gpus must be at least 1"),
        (["--num_nodes", "0"], "--num_nodes must be at least 1"),
        (["--max_restarts", "-1"], "--max_restarts must be at least 0"),
        (["--master_port", "70000"], "--master_port must be in 1..65535"),
        (["--include", "localhost:0", "--exclude", "localhost:1"], "cannot be used together"),
        (["--include", "localhost:0", "--num_gpus", "1"], "do not combine them with --num_gpus"),
        # node counts and elastic ranges
        (["--nnodes", "3:2"], "need 1 <= MIN <= MAX"),
        (["--nnodes", "two"], "expected a node count N or a range MIN:MAX"),
        (["--nnodes", "0"], "need 1 <= MIN <= MAX"),
        (
            ["--nnodes", "1:2", "--num_nodes", "2"],
            "--nnodes and --num_nodes both give the node count",
        ),
        (["--elastic_training"], "--elastic_training needs the node range"),
        (
            ["--min_elastic_nodes", "0", "--max_elastic_nodes", "2"],
            "--min_elastic_nodes must be at least 1",
        ),
        (["--min_elastic_nodes", "3", "--max_elastic_nodes", "2"], "need 1 <= MIN <= MAX"),
    ],
)
def test_check_args_rejects(tmp_path, argv, message):
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(LaunchError, match=message):
        check_args(parse(*argv, str(script)))


def test_check_args_missing_script(tmp_path):
    with pytest.raises(LaunchError, match="training script .*nope.py' not found"):
        check_args(parse(str(tmp_path / "nope.py")))
    check_args(parse("--module", "some.module"))  # modules are not files


# --- planning: this machine ----------------------------------------------------


def test_cpu_machine_defaults_to_one_process():
    plan = plan_launch(parse("t.py"), None, local_slot_count=16, gpus_present=False)
    assert not plan.remote and plan.num_nodes == 1
    assert plan.nodes[0].slots == (0,)
    assert (plan.master_addr, plan.master_port) == ("127.0.0.1", 29500)


def test_gpu_machine_defaults_to_every_gpu():
    plan = plan_launch(parse("t.py"), None, local_slot_count=8, gpus_present=True)
    assert plan.nodes[0].nproc == 8


def test_num_procs_on_cpu_is_not_bounded_by_cores():
    plan = plan_launch(
        parse("--num_procs", "6", "t.py"), None, local_slot_count=2, gpus_present=False
    )
    assert plan.nodes[0].slots == tuple(range(6))


def test_num_gpus_beyond_local_gpus_rejected():
    with pytest.raises(LaunchError, match="only 2 GPU"):
        plan_launch(parse("--num_gpus", "4", "t.py"), None, local_slot_count=2, gpus_present=True)


def test_include_and_exclude_on_this_machine():
    plan = plan_launch(parse("--include", "localhost:1,3", "t.py"), None, 4, True)
    assert plan.nodes[0].slots == (1, 3)
    plan = plan_launch(parse("--exclude", "localhost:0", "t.py"), None, 4, True)
    assert plan.nodes[0].slots == (1, 2, 3)
    with pytest.raises(ValueError, match="has no slot 4"):
        plan_launch(parse("--include", "localhost:4", "t.py"), None, 4, True)


def test_manual_multi_node():
    args = parse(
        "--num_nodes",
        "3",
        "--node_rank",
        "2",
        "--master_addr",
        "10.0.0.1",
        "--num_gpus",
        "2",
        "t.py",
    )
    plan = plan_launch(args, None, 2, True)
    assert (plan.num_nodes, plan.nodes[0].node_rank, plan.master_addr) == (3, 2, "10.0.0.1")
    assert not plan.remote
    assert torchrun_argv(plan, plan.nodes[0], args)[:4] == ["--nnodes", "3", "--node_rank", "2"]


def test_node_rank_must_be_below_num_nodes():
    with pytest.raises(LaunchError, match="--node_rank 2 must be less than --num_nodes 2"):
        plan_launch(
            parse("--num_nodes", "2", "--node_rank", "2", "--master_addr", "h", "t.py"),
            None,
            1,
            False,
        )


def test_manual_multi_node_needs_master_addr():
    with pytest.raises(LaunchError, match="same --master_addr"):
        plan_launch(parse("--num_nodes", "2", "--node_rank", "1", "t.py"), None, 1, False)


# --- planning: hostfile ---------------------------------------------------------


def test_hostfile_plan_uses_every_host_first_is_master():
    plan = plan_launch(parse("t.py"), HOSTS, 0, False)
    assert plan.remote and plan.num_nodes == 3 and plan.master_addr == "worker-0"
    assert [n.node_rank for n in plan.nodes] == [0, 1, 2]
    assert slots(plan) == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}


def test_hostfile_num_nodes_and_num_gpus_take_the_first():
    plan = plan_launch(parse("--num_nodes", "2", "--num_gpus", "3", "t.py"), HOSTS, 0, False)
    assert slots(plan) == {"worker-0": [0, 1, 2], "worker-1": [0, 1, 2]}
    with pytest.raises(LaunchError, match="only 3 host"):
        plan_launch(parse("--num_nodes", "4", "t.py"), HOSTS, 0, False)
    with pytest.raises(LaunchError, match="host 'worker-2' has only 2 slot"):
        plan_launch(parse("--num_gpus", "3", "t.py"), HOSTS, 0, False)


def test_hostfile_include_and_master_addr_override():
    plan = plan_launch(
        parse("--include", "worker-1:2,3@worker-2", "--master_addr", "10.1.1.1", "t.py"),
        HOSTS,
        0,
        False,
    )
    assert slots(plan) == {"worker-1": [2, 3], "worker-2": [0, 1]}
    assert plan.master_addr == "10.1.1.1" and plan.nodes[0].node_rank == 0


def test_single_local_host_in_hostfile_runs_here():
    plan = plan_launch(
        parse("--include", "me:1", "t.py"), {"me": 2, "other": 2}, 0, False, lambda h: h == "me"
    )
    assert not plan.remote and plan.nodes[0].slots == (1,)
    away = plan_launch(
        parse("--include", "other", "t.py"), {"me": 2, "other": 2}, 0, False, lambda h: h == "me"
    )
    assert away.remote and away.master_addr == "other"


# --- environment for workers ------------------------------------------------------


def test_worker_env():
    plan = plan_launch(
        parse("--include", "localhost:1,3", "--no_local_rank", "t.py"), None, 4, True
    )
    env = worker_env(plan.nodes[0], parse("--no_local_rank", "t.py"), ["4", "5", "6", "7"])
    assert env == {"ZENGINE_NO_LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "5,7"}
    plan = plan_launch(parse("--num_gpus", "2", "t.py"), None, 4, True)
    assert worker_env(plan.nodes[0], parse("t.py"), ["0", "1", "2", "3"]) == {}
    cpu = plan_launch(parse("--include", "localhost:1", "t.py"), None, 4, False)
    assert worker_env(cpu.nodes[0], parse("--module", "m"), None) == {"ZENGINE_RUN_MODULE": "1"}


def test_local_torchrun_argv():
    args = parse(
        "--num_procs", "2", "--master_port", "1234", "--max_restarts", "3", "train.py", "a", "--b"
    )
    plan = plan_launch(args, None, 1, False)
    # with restarts: the c10d rendezvous (a fresh store per round), no node rank (c10d numbers nodes)
    assert torchrun_argv(plan, plan.nodes[0], args) == [
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        "127.0.0.1:1234",
        "--rdzv_id",
        "zengine-1234",
        "--max_restarts",
        "3",
        "-m",
        "zengine.launcher.entry",
        "train.py",
        "a",
        "--b",
    ]
    args = parse("--num_procs", "2", "--master_port", "1234", "train.py")
    assert torchrun_argv(plan, plan.nodes[0], args)[:10] == [
        "--nnodes",
        "1",
        "--node_rank",
        "0",
        "--nproc_per_node",
        "2",
        "--rdzv_backend",
        "static",
        "--master_addr",
        "127.0.0.1",
    ]


def test_exported_env_and_env_files(tmp_path):
    home_file = tmp_path / ".deepspeed_env"
    home_file.write_text("# cluster settings\nNCCL_IB_DISABLE=1\nMY_FLAG=a=b\n\n")
    cwd_file = tmp_path / ".zengine_env"
    cwd_file.write_text("MY_FLAG=override\n")
    environ = {
        "NCCL_DEBUG": "INFO",
        "PYTHONPATH": "/src",
        "PATH": "/bin",
        "HOME": "/root",
        "SECRET": "x",
    }
    assert exported_env(environ, [str(home_file), str(cwd_file)]) == {
        "NCCL_DEBUG": "INFO",
        "PYTHONPATH": "/src",
        "PATH": "/bin",
        "NCCL_IB_DISABLE": "1",
        "MY_FLAG": "override",
    }
    bad = tmp_path / "bad_env"
    bad.write_text("GOOD=1\nnot a pair\n")
    with pytest.raises(LaunchError, match=r"bad_env, line 2: expected KEY=VALUE"):
        read_env_file(str(bad))


def test_ssh_commands():
    args = parse(
        "--include",
        "worker-0:0,1@worker-1:2,3",
        "--master_port",
        "6000",
        "--no_local_rank",
        "--ssh_port",
        "2222",
        "train.py",
        "--name",
        "two words",
    )
    plan = plan_launch(args, HOSTS, 0, False)
    exports = {"NCCL_DEBUG": "INFO", "PATH": "/usr/bin"}
    commands = [
        ssh_command(plan, n, args, exports, "/data/my job", "/usr/bin/python3") for n in plan.nodes
    ]
    assert [c[:5] for c in commands] == [
        ["ssh", "-p", "2222", "--", "worker-0"],
        ["ssh", "-p", "2222", "--", "worker-1"],
    ]
    assert commands[1][5] == (
        "cd '/data/my job' && env NCCL_DEBUG=INFO PATH=/usr/bin ZENGINE_NO_LOCAL_RANK=1 "
        "CUDA_VISIBLE_DEVICES=2,3 /usr/bin/python3 -u -m torch.distributed.run "
        "--nnodes 2 --node_rank 1 --nproc_per_node 2 --rdzv_backend static "
        "--master_addr worker-0 --master_port 6000 --max_restarts 0 "
        "-m zengine.launcher.entry train.py --name 'two words'"
    )
    # The remote shell splits it back into the same words.
    words = shlex.split(commands[0][5])
    assert words[words.index("zengine.launcher.entry") + 1 :] == ["train.py", "--name", "two words"]
    assert "CUDA_VISIBLE_DEVICES=0,1" not in words  # slots 0..n-1 need no narrowing
    assert words[words.index("--node_rank") + 1] == "0"


def test_pdsh_command():
    """One pdsh for every host; pdsh writes each host's index where the command says %n."""
    args = parse(
        "--launcher",
        "pdsh",
        "--include",
        "worker-0:0,1@worker-1:0,1",
        "--master_port",
        "6000",
        "--ssh_port",
        "2222",
        "train.py",
        "--name",
        "two words",
    )
    plan = plan_launch(args, HOSTS, 0, False)
    command = pdsh_command(plan, args, {"NCCL_DEBUG": "INFO"}, "/data/my job", "/usr/bin/python3")
    assert command[:9] == [
        "env",
        "PDSH_RCMD_TYPE=ssh",
        "PDSH_SSH_ARGS_APPEND=-p 2222",
        "pdsh",
        "-S",
        "-f",
        "1024",
        "-w",
        "worker-0,worker-1",
    ]
    assert command[9] == (
        "cd '/data/my job' && env NCCL_DEBUG=INFO /usr/bin/python3 -u -m torch.distributed.run "
        "--nnodes 2 --node_rank %n --nproc_per_node 2 --rdzv_backend static "
        "--master_addr worker-0 --master_port 6000 --max_restarts 0 "
        "-m zengine.launcher.entry train.py --name 'two words'"
    )
    uneven = parse("--launcher", "pdsh", "--include", "worker-0:0,1@worker-1:2,3", "train.py")
    with pytest.raises(LaunchError, match="different slots"):
        pdsh_command(plan_launch(uneven, HOSTS, 0, False), uneven, {}, "/", "python")


# --- main: errors before anything starts ------------------------------------------------


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def run_main_error(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_main_errors(capsys, tmp_path, script):
    assert "training script 'missing.py' not found" in run_main_error(capsys, "missing.py")
    assert "--num_gpus must be at least 1" in run_main_error(capsys, "--num_gpus", "0", script)
    assert "hostfile" in run_main_error(capsys, "--hostfile", str(tmp_path / "nohosts"), script)
    assert "not found" in run_main_error(capsys, "--hostfile", str(tmp_path / "nohosts"), script)
    assert "cannot be used together" in run_main_error(
        capsys, "-i", "localhost", "-e", "localhost:0", script
    )
    assert "has no slot 100000" in run_main_error(capsys, "--include", "localhost:100000", script)
    assert "must be less than --num_nodes" in run_main_error(
        capsys, "--num_nodes", "2", "--node_rank", "5", "--master_addr", "h", script
    )


def test_main_hostfile_errors(capsys, tmp_path, script):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=2\na slots=2\n")
    assert "line 2: host 'a' is listed twice" in run_main_error(capsys, "-H", str(hostfile), script)
    hostfile.write_text("a slots=2\nb slots=2\n")
    assert "unknown host 'c'" in run_main_error(capsys, "-H", str(hostfile), "-i", "c", script)
    assert "--node_rank is for starting nodes by hand" in run_main_error(
        capsys, "-H", str(hostfile), "--node_rank", "0", script
    )


@pytest.fixture
def started(monkeypatch):
    """The ssh commands main() would start, recorded instead of run."""
    commands = []

    def run_remote(cmds):
        commands.extend(cmds)
        return 0

    monkeypatch.setattr(runner, "run_remote", run_remote)
    return commands


def test_main_unresolvable_host_fails_before_ssh(capsys, tmp_path, script, started, monkeypatch):
    composed = []
    monkeypatch.setattr(runner, "ssh_command", lambda *a: composed.append(a) or ["ssh"])
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# cluster\nlocalhost slots=1\nno-such-host.invalid slots=2\n")
    err = run_main_error(capsys, "-H", str(hostfile), script)
    assert f"{hostfile}, line 3: host 'no-such-host.invalid' does not resolve" in err, err
    assert "localhost'" not in err and composed == [] and started == []
    # --include decides the hosts: naming the bad one fails the same way
    err = run_main_error(capsys, "-H", str(hostfile), "-i", "no-such-host.invalid:1", script)
    assert "line 3: host 'no-such-host.invalid' does not resolve" in err and started == []


def test_main_refuses_option_like_hosts_before_anything_runs(
    capsys, tmp_path, script, started, monkeypatch
):
    """A hostfile host or --master_addr starting with '-' would be an ssh/pdsh option: refused, by line, first."""
    composed, resolved = [], []
    monkeypatch.setattr(runner, "ssh_command", lambda *a: composed.append(a) or ["ssh"])
    monkeypatch.setattr(runner, "resolve_for_ssh", resolved.append)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n-oProxyCommand=/tmp/pwn.sh slots=1\n")
    for launcher in ("ssh", "pdsh"):
        err = run_main_error(capsys, "-H", str(hostfile), "--launcher", launcher, script)
        assert f"{hostfile}, line 2: host '-oProxyCommand=/tmp/pwn.sh' starts with '-'" in err, err
    err = run_main_error(
        capsys, "--num_nodes", "2", "--node_rank", "1", "--master_addr=-oProxyJump=x", script
    )
    assert "--master_addr '-oProxyJump=x' starts with '-'" in err, err
    assert composed == [] and resolved == [] and started == []


def test_pdsh_refuses_names_its_host_list_reads_otherwise():
    """ssh gets ``--`` before the host; pdsh's -w list has no such end, so what it would not take for a host
    name (a leading '-' excludes, '^' reads a file, '/' filters, ',' separates) is refused."""
    args = parse("--launcher", "pdsh", "train.py")
    for odd in ("-oProxyCommand=x", "^/etc/hosts", "/wor/", "a,b"):
        plan = LaunchPlan(
            nodes=(NodePlan("worker-0", 0, (0,)), NodePlan(odd, 1, (0,))),
            num_nodes=2,
            master_addr="worker-0",
            master_port=6000,
            remote=True,
        )
        with pytest.raises(
            LaunchError, match=re.escape(f"pdsh would not read {odd!r} as host names")
        ):
            pdsh_command(plan, args, {}, "/", "python")
        assert ssh_command(plan, plan.nodes[1], args, {}, "/", "python")[1:3] == ["--", odd]


def test_main_checks_only_the_hosts_it_runs_on(tmp_path, script, started):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\nno-such-host.invalid slots=1\n")
    assert main(["-H", str(hostfile), "--exclude", "no-such-host.invalid", script]) == 0
    assert [c[c.index("--") + 1] for c in started] == ["localhost", "127.0.0.1"]


def test_ssh_config_decides_which_name_must_resolve(monkeypatch):
    """An ssh alias is checked through its HostName; a host behind a ProxyJump is resolved elsewhere."""
    config = {
        "alias": "hostname 127.0.0.1\nport 22\n",
        "typo": "hostname no-such-host.invalid\n",
        "inner": "hostname no-such-host.invalid\nproxyjump bastion\n",
    }

    def ssh_g(argv, **kwargs):
        assert argv[:2] == ["ssh", "-G"] and kwargs["stdin"] is subprocess.DEVNULL
        return subprocess.CompletedProcess(argv, 0, config[argv[2]], "")

    monkeypatch.setattr(remote.subprocess, "run", ssh_g)
    resolve_for_ssh("alias")
    resolve_for_ssh("inner")
    with pytest.raises(socket.gaierror):
        resolve_for_ssh("typo")
    with pytest.raises(socket.gaierror):
        resolve_for_ssh("-oProxyCommand=x")  # never handed to ssh as an option


def test_main_rejects_busy_master_port(capsys, script):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert f"--master_port {port} is already in use" in run_main_error(
            capsys, "--master_port", str(port), script
        )


# --- the script side ---------------------------------------------------------------------


def test_add_config_arguments():
    parser = argparse.ArgumentParser()
    assert add_config_arguments(parser) is parser
    args = parser.parse_args(
        ["--deepspeed", "--deepspeed_config", "ds.json", "--zengine_config", "z.json"]
    )
    assert (args.deepspeed, args.deepspeed_config, args.zengine_config) == (
        True,
        "ds.json",
        "z.json",
    )
    defaults = parser.parse_args([])
    assert (defaults.deepspeed, defaults.deepspeed_config, defaults.zengine_config) == (
        False,
        None,
        None,
    )
    assert not hasattr(defaults, "local_rank")  # as in DeepSpeed, the script declares it


def test_entry_argv():
    assert target_argv("t.py", ["a"], {"LOCAL_RANK": "3"}) == ["t.py", "--local_rank=3", "a"]
    assert target_argv("t.py", ["a"], {"LOCAL_RANK": "3", "ZENGINE_NO_LOCAL_RANK": "1"}) == [
        "t.py",
        "a",
    ]


# --- node counts and rendezvous ----------------------------------------------


def test_elastic_node_range_uses_c10d_with_a_store_per_round():
    args = parse(
        "--nnodes",
        "1:2",
        "--num_procs",
        "2",
        "--master_addr",
        "10.0.0.1",
        "--master_port",
        "6000",
        "--rdzv_conf",
        "last_call_timeout=5",
        "t.py",
    )
    plan = plan_launch(args, None, 2, False)
    assert (plan.num_nodes, plan.node_range.min_nodes, plan.node_range.elastic) == (2, 1, True)
    argv = torchrun_argv(plan, plan.nodes[0], args)
    assert argv[:2] == ["--nnodes", "1:2"] and "--node_rank" not in argv  # c10d numbers the nodes
    assert argv[argv.index("--rdzv_backend") + 1] == "c10d"
    assert argv[argv.index("--rdzv_endpoint") + 1] == "10.0.0.1:6000"
    assert argv[argv.index("--rdzv_conf") + 1] == "last_call_timeout=5"
    from zengine.launcher.rendezvous import rendezvous_env

    assert rendezvous_env(args, plan.node_range) == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    fixed = parse("--num_procs", "2", "t.py")
    assert rendezvous_env(fixed, plan_launch(fixed, None, 2, False).node_range) == {}


def test_deepspeed_elastic_options_mean_the_same_range():
    a = parse("--nnodes", "2:3", "t.py")
    b = parse("--elastic_training", "--min_elastic_nodes", "2", "--max_elastic_nodes", "3", "t.py")
    plans = [plan_launch(x, HOSTS, 0, False) for x in (a, b)]
    assert [p.node_range for p in plans] == [plans[0].node_range] * 2
    assert (plans[0].node_range.min_nodes, plans[0].num_nodes) == (2, 3)
    # over ssh every host's torchrun gets the range and the shared-store switch, and pdsh keeps no %n
    command = ssh_command(plans[0], plans[0].nodes[2], a, {}, "/job", "python")[-1]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in command and "--nnodes 2:3" in command
    assert "--node_rank" not in command
    even = parse("--launcher", "pdsh", "--nnodes", "1:2", "--num_procs", "2", "t.py")
    remote = pdsh_command(plan_launch(even, HOSTS, 0, False), even, {}, "/job", "python")[-1]
    assert "--nnodes 1:2" in remote and "%n" not in remote
