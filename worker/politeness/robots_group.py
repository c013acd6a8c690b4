"""The part of a robots.txt that applies to us, as a robots.txt of its own.

The cluster shares each origin's robots.txt through Redis and every worker
keeps it parsed in memory; a hostile site can send 500 KiB of rules for
other crawlers, which would cost ~20 MiB per parse. Only the group our
product token selects matters (RFC 9309 section 2.2.1: the most specific
matching group, all of its occurrences merged; ``*`` otherwise), so that
group is what is stored: ``Allow``, ``Disallow`` and ``Crawl-delay`` lines
under one ``User-agent`` line, which Protego reads back to the same answers as the
full file.

The file is split into groups the way Protego reads it (its own directive
reader, the same grouping rule), and the group is chosen by Protego's own
matching score, so the two cannot disagree on which lines are ours.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from protego import Protego
# Protego's reader and matcher, so the grouping here is the one the parser applies.
from protego._protego import (_ALLOW_DIRECTIVE, _CRAWL_DELAY_DIRECTIVE, _DISALLOW_DIRECTIVE,
                              _SITE_WIDE_DIRECTIVES, _USER_AGENT_DIRECTIVE, _extract_directive)
from protego._ruleset import _RuleSet

# Our group is stored and parsed by every worker; a longer one is refused (GroupTooLarge).
# Real files' groups are a few KiB; 64 KiB parsed costs ~1 MiB of a worker's memory.
MAX_GROUP_BYTES = 64 * 1024

CONTENT_USAGE_DIRECTIVE = "content-usage"  # draft-ietf-aipref-attach: a rule of a group, as Allow is
_KEPT = {**{name: "Allow" for name in _ALLOW_DIRECTIVE},
         **{name: "Disallow" for name in _DISALLOW_DIRECTIVE},
         **{name: "Crawl-delay" for name in _CRAWL_DELAY_DIRECTIVE},
         CONTENT_USAGE_DIRECTIVE: "Content-Usage"}


class GroupTooLarge(ValueError):
    """Our group is longer than MAX_GROUP_BYTES."""


@dataclass
class _Group:
    agents: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def _groups(body: str) -> list[_Group]:
    """The record groups of ``body`` as Protego forms them (``Protego._parse_robotstxt``)."""
    groups: list[_Group] = []
    current: _Group | None = None
    previous_field: str | None = None
    for line in body.splitlines():
        hash_pos = line.find("#")
        if hash_pos != -1:
            line = line[:hash_pos]
        line = line.strip()
        if not line:
            continue
        parsed = _extract_directive(line)
        if parsed is None:
            continue
        name, value = parsed
        is_agent = name in _USER_AGENT_DIRECTIVE
        if is_agent and previous_field is not None and previous_field not in _USER_AGENT_DIRECTIVE:
            current = None  # a user-agent line after rules starts a new group
        if name not in _SITE_WIDE_DIRECTIVES:
            previous_field = name
        if not value:
            continue
        if is_agent:
            if current is None:
                current = _Group()
                groups.append(current)
            agent = value.lower()
            current.agents.append(agent)
            if agent != "*" and "*" in agent:
                current.agents.append(agent.replace("*", ""))
        elif current is not None and name in _KEPT:
            current.lines.append(f"{_KEPT[name]}: {value}")
    return groups


def _best_agent(agents: list[str], token: str) -> str | None:
    """The user-agent name Protego would match ``token`` to (the first of the best, in the
    file's order, as Protego's ``max`` picks), or None."""
    best, best_score = None, 0
    parser = Protego()
    for agent in agents:
        rule_set = _RuleSet(parser)
        rule_set.user_agent = agent
        score = rule_set.applies_to(token)
        if score > best_score:
            best, best_score = agent, score
    return best


def our_group(body: str, token: str) -> str:
    """The robots.txt of ``body``'s rules for ``token`` alone ("" when no group applies:
    everything allowed). Raises GroupTooLarge past MAX_GROUP_BYTES."""
    return groups_for(body, (token,))[token]


def groups_for(body: str, tokens: tuple[str, ...]) -> dict[str, str]:
    """Per product token, the robots.txt of ``body``'s rules for it alone (``our_group``). Raises
    GroupTooLarge if they are longer than MAX_GROUP_BYTES together (a group two tokens
    share is counted once)."""
    groups = _groups(body)
    agents = list(dict.fromkeys(a for g in groups for a in g.agents if a))
    found: dict[str, str] = {}
    texts: dict[str, str] = {}  # by agent: tokens that select the same group share it
    for token in tokens:
        agent = _best_agent(agents, token)
        if agent is None:
            found[token] = ""
            continue
        if agent not in texts:
            lines = [line for g in groups if agent in g.agents for line in g.lines]
            texts[agent] = f"User-agent: {agent}\n" + "".join(f"{line}\n" for line in lines)
        found[token] = texts[agent]
    size = sum(len(text.encode()) for text in texts.values())
    if size > MAX_GROUP_BYTES:
        raise GroupTooLarge(f"the robots.txt groups for {', '.join(tokens)} are {size} bytes")
    return found
