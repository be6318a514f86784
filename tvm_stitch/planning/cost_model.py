"""The learned cost model: picks one of a group's candidate configurations.

One XGBoost ranking model (pairwise, each stitched group a query) per
target family, trained by `tvm-stitch train` on the records of `tvm-stitch
tune`, shipped as XGBoost's JSON model in planning/cost_models/<family>.json.
A candidate's relevance is minus the log of its time over the median time
of its group's candidates; the candidate with the highest score is chosen.
Ranking rather than regressing times: only the order inside a group
matters, and pairs of candidates timed in the same rounds are steadier than
times on a shared machine (leave-one-shape-out on the training records:
more groups within 10% of their best than regression).

At compile time the trees are walked here, in Python (importing xgboost
alone costs about a second, more than most compilations). The shipped
models are read once, when this module is imported (`SHIPPED`, read-only:
parsing the JSON costs about 25 ms, a tenth of a small compilation);
`load_model(family, folder)` reads one from any folder, and the stitch pass
can be given a model (`StitchFusion(cost_model=model)`). No model for the
target, a model that does not load, or features it was not trained on: the
rule-based plan is used.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import MappingProxyType

import numpy as np
from tvm import tirx

from tvm_stitch.planning.candidates import candidates, knobs
from tvm_stitch.planning.features import FEATURES, features, group_facts
from tvm_stitch.planning.plan import StitchPlan
from tvm_stitch.planning.spec import TargetSpec

MODELS = Path(__file__).resolve().parent / "cost_models"  # the shipped models (package data)
OBJECTIVE = "rank:pairwise"  # within a group, order pairs of candidates by their times
TRAIN_PARAMS = MappingProxyType({"max_depth": 4, "eta": 0.05, "objective": OBJECTIVE, "nthread": 1, "seed": 0,
                                 "tree_method": "exact"})
ROUNDS = 200


class ModelError(Exception):
    """A model file that cannot be used; the message says why."""


@dataclasses.dataclass(frozen=True)
class Model:
    """An XGBoost tree ensemble (gbtree, one target), read from its JSON.

    The trees are stacked into arrays (tree x node), so that all trees walk
    all candidates in step: one numpy step per tree level.
    """

    base_score: float
    left: np.ndarray
    right: np.ndarray
    feature: np.ndarray
    threshold: np.ndarray  # float32; at a leaf, the leaf's value
    default_left: np.ndarray
    depth: int
    feature_names: tuple

    @staticmethod
    def from_json(text: str) -> "Model":
        try:
            learner = json.loads(text)["learner"]
            booster = learner["gradient_booster"]
            if booster["name"] != "gbtree":
                raise ModelError(f"booster {booster['name']!r}, expected gbtree")
            if learner["objective"]["name"] != OBJECTIVE:
                raise ModelError(f"objective {learner['objective']['name']!r}, expected {OBJECTIVE}")
            base = float(learner["learner_model_param"]["base_score"].strip("[]"))
            trees = booster["model"]["trees"]
            if not trees:
                raise ModelError("no trees")
            width = max(len(t["left_children"]) for t in trees)

            def stack(key, dtype, pad):
                out = np.full((len(trees), width), pad, dtype=dtype)
                for i, tree in enumerate(trees):
                    out[i, :len(tree[key])] = tree[key]
                return out

            left, right = stack("left_children", np.int32, -1), stack("right_children", np.int32, -1)
            model = Model(float(np.float32(base)), left, right,
                          stack("split_indices", np.int32, 0), stack("split_conditions", np.float32, 0.0),
                          stack("default_left", bool, False), _depth(left, right),
                          tuple(learner.get("feature_names", ())))
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise ModelError(f"not an XGBoost JSON model: {type(err).__name__}: {err}") from err
        if model.feature.size and int(model.feature.max()) >= max(1, len(model.feature_names)):
            raise ModelError("a split uses a feature the model does not name")
        return model

    def costs(self, rows: list) -> list:
        """Lower is faster: the negated ranking scores."""
        return [-score for score in self.predict(rows)]

    def predict(self, rows: list) -> list:
        """The raw scores, as XGBoost's predict gives them (higher ranks first)."""
        x = np.asarray(rows, dtype=np.float32)  # XGBoost compares float32 features with float32 splits
        trees = np.arange(self.left.shape[0])[:, None]
        node = np.zeros((self.left.shape[0], x.shape[0]), dtype=np.int32)
        cols = np.arange(x.shape[0])[None, :]
        for _ in range(self.depth):
            value = x[cols, self.feature[trees, node]]
            go_left = np.where(np.isnan(value), self.default_left[trees, node], value < self.threshold[trees, node])
            child = np.where(go_left, self.left[trees, node], self.right[trees, node])
            node = np.where(child == -1, node, child)
        leaves = self.threshold[trees, node].astype(np.float64)
        return [self.base_score + float(v) for v in leaves.sum(axis=0)]


def _depth(left: np.ndarray, right: np.ndarray) -> int:
    """The longest root-to-leaf path over the trees (XGBoost numbers children after their parents)."""
    level = np.zeros_like(left)
    for i in range(left.shape[1]):
        rows = np.nonzero(left[:, i] >= 0)[0]
        for children in (left, right):
            level[rows, children[rows, i]] = level[rows, i] + 1
    return int(level.max())


def model_path(family: str, folder: Path = MODELS) -> Path:
    return folder / f"{family}.json"


def load_model(family: str, folder: Path = MODELS) -> Model | None:
    """The model of a target family in `folder` (default: the shipped ones); None if there is
    none, it does not load, or it was trained on other features."""
    path = model_path(family, folder)
    if not path.is_file():
        return None
    try:
        model = Model.from_json(path.read_text(encoding="utf-8"))
    except (OSError, ModelError):
        return None
    if model.feature_names != FEATURES:
        return None  # trained on other features: its predictions mean nothing here
    return model


def _shipped() -> MappingProxyType:
    models = {path.stem: load_model(path.stem) for path in sorted(MODELS.glob("*.json"))}
    return MappingProxyType({family: model for family, model in models.items() if model is not None})


SHIPPED = _shipped()  # family -> Model: the usable models shipped with the package


def choose(model, fused: tirx.PrimFunc, rule: StitchPlan, spec: TargetSpec) -> StitchPlan:
    """The candidate with the lowest predicted time (`model.costs`); the rule plan on ties (it comes first).

    A kernel of symbolic size keeps the rule plan: the model's features are
    sizes, which only the run knows.
    """
    if rule.mapping.rows < 0:
        return dataclasses.replace(rule, notes=rule.notes + ("symbolic size: the rule plan, not the cost model's",))
    plans = candidates(fused, rule, spec)
    if len(plans) == 1:
        return rule
    facts = group_facts(fused)
    scores = model.costs([features(facts, plan, rule) for plan in plans])
    best = min(range(len(plans)), key=lambda i: (scores[i], i))
    if best == 0:
        return rule
    chosen = plans[best]
    k = knobs(rule)
    note = (f"cost model: candidate {best + 1} of {len(plans)} "
            f"(rules: rank {k['rank']}, threads {k['threads']}, vector {k['vector']})")
    return dataclasses.replace(chosen, notes=chosen.notes + (note,))


def train(records: list, out: Path) -> dict:
    """Train the model on tune records (see tune.py) and write it; returns a summary."""
    import xgboost as xgb

    rows, labels, sizes = [], [], []
    for record in records:
        timed = [c for c in record["candidates"] if c.get("ms") is not None and c.get("agrees", True)]
        if len(timed) < 2:
            continue
        middle = float(np.median([c["ms"] for c in timed]))
        for c in timed:
            if len(c["features"]) != len(FEATURES):
                raise ValueError(f"record {record['group']}: {len(c['features'])} features, expected {len(FEATURES)}")
            rows.append(c["features"])
            labels.append(-math.log2(c["ms"] / middle))  # relevance: higher is faster
        sizes.append(len(timed))
    if not rows:
        raise ValueError("no group with two or more timed candidates in the records")
    data = xgb.DMatrix(np.asarray(rows, dtype=np.float32), label=np.asarray(labels, dtype=np.float32),
                       feature_names=list(FEATURES))
    data.set_group(sizes)
    booster = xgb.train(dict(TRAIN_PARAMS), data, num_boost_round=ROUNDS)
    out.parent.mkdir(parents=True, exist_ok=True)
    booster.save_model(str(out))
    return {"groups": len(records), "candidates": len(rows), "rounds": ROUNDS, "path": str(out)}
