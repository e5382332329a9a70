"""Hostfiles and the ``--include`` / ``--exclude`` slot filters, in DeepSpeed's formats.

Pure functions, but for :func:`check_hosts_resolve`, which asks a resolver
(passed in) whether each host has an address, so that a misspelled host fails
before any ssh starts.

A hostfile lists one machine per line with the number of slots (accelerators,
or processes on a CPU machine) it offers::

    # comments and blank lines are ignored
    worker-0 slots=4
    worker-1 slots=4   # a trailing comment is fine too

A host name may not start with ``-`` (ssh and pdsh would take it for an option).

A filter names hosts separated by ``@``, each optionally followed by ``:`` and
a comma-separated list of slot indices: ``worker-0:0,1@worker-1`` means slots
0 and 1 of worker-0 and every slot of worker-1. ``--include`` keeps only what
it names; ``--exclude`` removes what it names (a bare host removes the host).

Resolved resources are an insertion-ordered ``dict`` mapping each host, in
hostfile order, to its sorted list of slot indices.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping

HOST_SEP = "@"
SLOTS_START = ":"
SLOT_SEP = ","

Resources = dict[str, list[int]]
# A host name reaches ssh and pdsh command lines: one that starts with '-' would be read there as an option
# (``-oProxyCommand=...`` runs a command), so it is refused wherever a host name comes in.
OPTION_LIKE = "starts with '-': it is not a host name, and ssh or pdsh would read it as an option"


class HostfileError(ValueError):
    """A hostfile or a slot filter that cannot be understood or satisfied."""


class Hostfile(dict):
    """``{hostname: slot_count}`` in file order that remembers where each host is listed, for messages."""

    def __init__(self, source: str):
        super().__init__()
        self.source = source
        self.lines: dict[str, int] = {}  # host -> line number

    def where(self, host: str) -> str:
        """``"<file>, line <n>"`` for a listed host."""
        return f"{self.source}, line {self.lines[host]}"


def parse_hostfile_lines(lines: Iterable[str], source: str = "<hostfile>") -> Hostfile:
    """Parse hostfile text into ``{hostname: slot_count}`` in file order.

    ``source`` names the file in error messages, which also give the line number.
    """
    hosts = Hostfile(source)
    first_seen = hosts.lines
    for lineno, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}, line {lineno}"
        fields = line.split()
        if len(fields) != 2 or not fields[1].startswith("slots="):
            raise HostfileError(f"{where}: expected 'hostname slots=N', got {raw.strip()!r}")
        host, count_text = fields[0], fields[1][len("slots=") :]
        if host.startswith("-"):
            raise HostfileError(
                f"{where}: host {host!r} {OPTION_LIKE}; correct the name in the hostfile"
            )
        try:
            count = int(count_text)
        except ValueError:
            raise HostfileError(
                f"{where}: slot count {count_text!r} of host {host!r} is not an integer"
            ) from None
        if count < 1:
            raise HostfileError(f"{where}: host {host!r} has slots={count}; it must be at least 1")
        if host in hosts:
            raise HostfileError(
                f"{where}: host {host!r} is listed twice (first on line {first_seen[host]})"
            )
        hosts[host] = count
        first_seen[host] = lineno
    return hosts


def parse_hostfile(path: str) -> Hostfile:
    """Read and parse the hostfile at ``path``; see :func:`parse_hostfile_lines`."""
    if not os.path.isfile(path):
        raise HostfileError(f"hostfile {path!r} not found")
    with open(path, encoding="utf-8") as f:
        hosts = parse_hostfile_lines(f, source=path)
    if not hosts:
        raise HostfileError(f"hostfile {path!r} lists no hosts")
    return hosts


def parse_filter(text: str, option: str = "filter") -> dict[str, list[int] | None]:
    """Parse ``host1:0,1@host2`` into ``{"host1": [0, 1], "host2": None}``.

    ``None`` means "every slot of that host". ``option`` names the
    command-line option in error messages.
    """
    parsed: dict[str, list[int] | None] = {}
    for entry in text.split(HOST_SEP):
        host, has_slots, slot_text = entry.partition(SLOTS_START)
        host = host.strip()
        if not host:
            raise HostfileError(f"{option} {text!r}: empty host name in entry {entry!r}")
        if host.startswith("-"):
            raise HostfileError(f"{option} {text!r}: host {host!r} {OPTION_LIKE}")
        slots: list[int] | None = None
        if has_slots:
            slots = []
            for item in slot_text.split(SLOT_SEP):
                try:
                    slot = int(item)
                except ValueError:
                    raise HostfileError(
                        f"{option} {text!r}: slot {item.strip()!r} of host {host!r} "
                        "is not an integer"
                    ) from None
                if slot < 0:
                    raise HostfileError(
                        f"{option} {text!r}: slot {slot} of host {host!r} is negative"
                    )
                slots.append(slot)
        if host in parsed:
            previous = parsed[host]
            parsed[host] = None if previous is None or slots is None else previous + slots
        else:
            parsed[host] = slots
    return parsed


def resolve_resources(hosts: dict[str, int], include: str = "", exclude: str = "") -> Resources:
    """Apply ``include`` or ``exclude`` (not both) to ``hosts``.

    Returns ``{host: sorted slot indices}`` in hostfile order, leaving out
    hosts with no slots left. Naming a host or slot that ``hosts`` lacks is an
    error, and so is a filter that leaves nothing.
    """
    if include and exclude:
        raise HostfileError("--include and --exclude cannot be used together")
    every = {host: list(range(count)) for host, count in hosts.items()}
    if not include and not exclude:
        return every

    option = "--include" if include else "--exclude"
    wanted = parse_filter(include or exclude, option)
    for host, slots in wanted.items():
        if host not in hosts:
            known = ", ".join(hosts) or "none"
            raise HostfileError(f"{option}: unknown host {host!r} (known hosts: {known})")
        for slot in slots or ():
            if slot >= hosts[host]:
                raise HostfileError(
                    f"{option}: host {host!r} has no slot {slot} "
                    f"(it has slots 0..{hosts[host] - 1})"
                )

    resolved: Resources = {}
    for host, all_slots in every.items():
        named = wanted.get(host, ())
        if include:
            kept = (
                [] if host not in wanted else (all_slots if named is None else sorted(set(named)))
            )
        else:
            kept = [] if named is None else [s for s in all_slots if s not in set(named)]
        if kept:
            resolved[host] = kept
    if not resolved:
        raise HostfileError(f"{option} {include or exclude!r} leaves no slots to run on")
    return resolved


def check_hosts_resolve(
    names: Iterable[str], hosts: Mapping[str, int], resolve: Callable[[str], object]
) -> None:
    """Raise HostfileError naming each of ``names`` for which ``resolve`` raises OSError.

    ``resolve`` is e.g. ``lambda host: socket.getaddrinfo(host, None)`` ('localhost' and IP
    literals pass without a lookup). ``hosts`` (a :class:`Hostfile`) gives each name's line.
    """
    problems = []
    for host in names:
        try:
            resolve(host)
        except (OSError, UnicodeError) as e:  # UnicodeError: a name that cannot even be encoded
            where = (
                hosts.where(host)
                if isinstance(hosts, Hostfile) and host in hosts.lines
                else "hostfile"
            )
            reason = getattr(e, "strerror", None) or str(e)
            problems.append(f"{where}: host {host!r} does not resolve ({reason})")
    if problems:
        raise HostfileError(
            (
                "a host of the job does"
                if len(problems) == 1
                else f"{len(problems)} hosts of the job do"
            )
            + " not resolve to an address, so nothing was started; correct the name in the hostfile "
            "or leave the host out with --exclude:\n  " + "\n  ".join(problems)
        )
