"""The view's first screen: the `Overview` group, and the place of the first NaN/Inf (the incident).

`Overview/` holds at most 12 charts, so that TensorBoard's first page of its first group shows all of them whatever
the sort: what a Megatron or DeepSpeed user reads first (the loss, the global grad norm, the learning rate and the
loss scale where the job logs them, the weights' global norm), the NaN and Inf elements over every tensor and rank,
the (tensor, rank) pairs holding one, the rank of the incident, and the stalled ranks.

The incident is the first NaN/Inf of the run: (step, micro-step, rank, layer, tensor). It is written once, as the
text `Overview/first_nonfinite`, and never replaced; each later step whose first NaN/Inf is somewhere else is said
under `Overview/first_nonfinite_then_reached`. From the incident on, the chart `Overview/first_nonfinite_rank in
<layer> (<family>)` holds its rank at every step: its title says where, its line starts at the step, its value is
the rank, on the first screen (the incident never changes, so neither does the tag).
"""
from __future__ import annotations

from typing import Callable, Optional

from trainmon.analysis.overflow import LOSS_SCALE
from trainmon.watch.aggregate import GRAD_NORM, PARAMS_NORM, Place, StepFigures, label_of, worst

OVERVIEW = "Overview"  # capitalised: TensorBoard sorts tag groups by code point, so it comes first
NAN_ELEMENTS, INF_ELEMENTS, TENSORS_NONFINITE = "nan_elements", "inf_elements", "tensors_nonfinite"
FIRST_NONFINITE_TAG = f"{OVERVIEW}/first_nonfinite"
THEN_REACHED_TAG = f"{FIRST_NONFINITE_TAG}_then_reached"
FIRST_NONFINITE_RANK_TAG = f"{FIRST_NONFINITE_TAG}_rank"
STALLED_RANKS_TAG = f"{OVERVIEW}/stalled_ranks"
# The scalars of the headline: of each, the first name the job logs (ours, Megatron's, the Trainer's). A norm the
# job logs comes before the one computed from the records.
HEADLINE_SCALARS = (("loss", "lm loss", "lm_loss"), ("grad-norm", GRAD_NORM), ("lr", "learning-rate", "learning_rate"),
                    (LOSS_SCALE, "loss-scale"), ("params-norm", PARAMS_NORM))


def headline_names(names) -> list[str]:
    """The scalars of `names` that the headline shows (at most one of each of HEADLINE_SCALARS)."""
    return [next(name for name in kind if name in names) for kind in HEADLINE_SCALARS
            if any(name in names for name in kind)]


class Headline:
    """The incident, and the first NaN/Inf place of the latest step that had one.

    Args:
        layer: names a tensor's layer, `ViewOptions.layer(family, name, vpp)`.
        state: what `state()` gave to an earlier daemon on the same log directory.
    """

    def __init__(self, layer: Callable[[str, str, int], str], state: Optional[dict] = None):
        self.layer = layer
        state = state or {}
        incident = state.get("incident")
        self.incident: Optional[tuple[int, Place]] = (incident[0], Place(*incident[1])) if incident else None
        self.latest: Optional[Place] = Place(*state["latest"]) if state.get("latest") else None

    def state(self) -> dict:
        return {"incident": self.incident and [self.incident[0], list(self.incident[1])],
                "latest": self.latest and list(self.latest)}

    def values(self, figure: StepFigures, stalled: int) -> list[tuple[str, float]]:
        """The headline's charts at this step: the largest over ranks, NaN winning."""
        series = figure.scalar_series()
        out = [(f"{OVERVIEW}/{name}", worst(series[name].values())) for name in headline_names(series)]
        if figure.recorded:  # a step without records has no count to show, not a count of 0
            counts = figure.nonfinite_elements.values()
            out += [(f"{OVERVIEW}/{NAN_ELEMENTS}", sum(c[0] for c in counts)),
                    (f"{OVERVIEW}/{INF_ELEMENTS}", sum(c[1] for c in counts)),
                    (f"{OVERVIEW}/{TENSORS_NONFINITE}", float(figure.tensors_nonfinite))]
        out.append((STALLED_RANKS_TAG, float(stalled)))
        self._note(figure)
        if self.incident is not None:
            place = self.incident[1]
            out.append((f"{FIRST_NONFINITE_RANK_TAG} in {self.layer(place.family, place.name, place.vpp)} "
                        f"({place.family})", float(place.rank)))
        return out

    def texts(self, figure: StepFigures) -> list[tuple[str, str]]:
        """(tag, markdown) to write at this step: the incident at its step, later a first NaN/Inf that moved."""
        if figure.worst is None or figure.worst == self.latest:
            return []
        self.latest = figure.worst
        if self.incident is not None and self.incident[0] == figure.step:
            return [(FIRST_NONFINITE_TAG, self._said(figure, "first NaN/Inf") + self._counts(figure))]
        return [(THEN_REACHED_TAG, self._said(figure, "then reached; this step's first NaN/Inf"))]

    def _note(self, figure: StepFigures) -> None:
        if self.incident is None and figure.worst is not None:
            self.incident = (figure.step, figure.worst)

    def _said(self, figure: StepFigures, what: str) -> str:
        place = figure.worst
        micro = "" if place.micro_step is None else f" micro-step {place.micro_step}"
        return (f"step {figure.step}{micro}: {what} in **{self.layer(place.family, place.name, place.vpp)}** "
                f"({place.family} `{label_of(place.name, place.vpp)}`) on rank {place.rank}")

    @staticmethod
    def _counts(figure: StepFigures) -> str:
        elements = figure.nonfinite_elements.get(figure.worst.family, (0.0, 0.0))
        return (f". This step: {figure.tensors_nonfinite} tensor(s) hold a NaN or Inf over all ranks; "
                f"{figure.worst.family} holds {elements[0]:.0f} NaN and {elements[1]:.0f} Inf elements")
