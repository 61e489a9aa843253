"""Where a fault-tolerant run keeps its shared state in the store: every key in one place."""

from __future__ import annotations


class Keys:
    """Key names of run ``run_id``; a generation ``g`` and a step ``s`` name one commit decision."""

    def __init__(self, run_id: str) -> None:
        self.root = f"gradsync/elastic/{run_id}"

    @property
    def arrivals(self) -> str:
        return f"{self.root}/arrivals"  # a counter: processes that asked to take part, ever

    def arrival(self, index: int) -> str:
        return f"{self.root}/arrival/{index}"  # the uuid of arrival ``index`` (1-based)

    def seat(self, uuid: str) -> str:
        return f"{self.root}/seat/{uuid}"  # the island a process trains in, and its rank there (islands.py)

    def admitted(self, uuid: str) -> str:
        return f"{self.root}/admitted/{uuid}"  # the generation a joiner was admitted to

    def heartbeat(self, uuid: str) -> str:
        return f"{self.root}/heartbeat/{uuid}"

    def left(self, uuid: str) -> str:
        return f"{self.root}/left/{uuid}"  # a member that finished on purpose

    def members(self, generation: int) -> str:
        return f"{self.root}/gen/{generation}/members"

    def present(self, generation: int, uuid: str) -> str:
        return f"{self.root}/gen/{generation}/present/{uuid}"

    def group_prefix(self, generation: int) -> str:
        return f"{self.root}/gen/{generation}/pg/"

    def trouble(self, generation: int) -> str:
        return f"{self.root}/gen/{generation}/trouble"  # set by a member settling a step (elastic/settle.py)

    def word(self, generation: int, uuid: str) -> str:
        return f"{self.root}/gen/{generation}/word/{uuid}"  # what a settling member says of itself

    def decision(self, generation: int, step: int) -> str:
        return f"{self.root}/gen/{generation}/step/{step}/decision"
