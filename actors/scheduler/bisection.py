"""Finding the request that kills the worker: bisecting the steps that were lost.

When the worker dies during a step, the core cannot tell which request of the step did it (a
bad shape, a token that trips a kernel fault). Every request of the lost step becomes a
suspect. Suspects are split into two groups, and a group is probed on its own: while a group
is probed, steps carry only its members, until each member has computed past the point it had
reached in the lost step; a member that gets there is cleared and schedules normally again. A
group whose probe is lost again splits again, so the request that kills the worker ends up
alone. Only a request that was alone in a lost step is charged: past `max_losses` such losses
it fails, and the innocent requests batched with it finish normally.

This module decides who is suspected and which group goes next; `scheduler.py` plans the steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sluice.actors.scheduler.plan import StepPlan
from sluice.actors.scheduler.request import Request, RequestState


@dataclass(slots=True)
class Suspect:
    group: int  # suspects of one group run together, apart from everyone else
    lost_at: int  # tokens computed at the end of its chunk in the lost step: cleared past it


class PoisonBisection:
    def __init__(self) -> None:
        self.suspects: dict[str, Suspect] = {}
        self.solo_losses: dict[str, int] = {}  # lost steps a request was alone in
        self._next_group = 0

    def step_lost(
        self, plan: StepPlan, live: Mapping[str, Request], max_losses: int
    ) -> list[str]:
        """Split the lost step's live requests into suspect groups; the ids that must fail."""
        members = [seq for seq in plan.seqs if seq.request_id in live]
        if len(members) == 1:
            rid = members[0].request_id
            losses = self.solo_losses[rid] = self.solo_losses.get(rid, 0) + 1
            if losses >= max_losses:
                self.forget(rid)
                return [rid]
        half = (len(members) + 1) // 2
        for part in (members[:half], members[half:]):
            if not part:
                continue
            group = self._next_group
            self._next_group += 1
            for seq in part:
                end = seq.start_pos + len(seq.token_ids)
                previous = self.suspects.get(seq.request_id)
                lost_at = max(end, previous.lost_at) if previous else end
                self.suspects[seq.request_id] = Suspect(group, lost_at)
        return []

    def probe_group(self, live: Mapping[str, Request]) -> frozenset[str] | None:
        """The suspects to run next, apart from all others; None when no group can run now.

        The oldest group with a member that is not paused goes first; a paused member waits
        for its client and holds nobody else up.
        """
        if not self.suspects:
            return None
        groups: dict[int, list[str]] = {}
        for rid, suspect in self.suspects.items():
            request = live.get(rid)
            if request is not None and request.state is not RequestState.PAUSED:
                groups.setdefault(suspect.group, []).append(rid)
        if not groups:
            return None
        return frozenset(groups[min(groups)])

    def step_done(self, plan: StepPlan, live: Mapping[str, Request]) -> None:
        """A step came back: clear the suspects that computed past their lost point."""
        if not self.suspects:
            return
        for seq in plan.seqs:
            suspect = self.suspects.get(seq.request_id)
            request = live.get(seq.request_id)
            if suspect is not None and request is not None:
                if request.num_computed_tokens >= suspect.lost_at:
                    del self.suspects[seq.request_id]

    def forget(self, rid: str) -> None:
        """The request ended: it is nobody's suspect any more."""
        self.suspects.pop(rid, None)
        self.solo_losses.pop(rid, None)

