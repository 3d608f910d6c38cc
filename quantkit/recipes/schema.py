"""Recipes: one YAML file describing calibrate -> (sensitivity -> plan) -> quantize -> evaluate -> gates -> smoke.

The schema is a tree of pydantic models; loading checks every key against it. Errors name the file, the line
and the key path, say what was expected, and suggest the closest valid key or choice for a typo. String values
may use ``${VAR}`` or ``${VAR:-default}`` and ``--set a.b=c`` overrides any key (see
:mod:`quantkit.recipes.overrides`). Each default is the one of the config class that uses the value. Relative
paths are relative to the current directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import AfterValidator, BaseModel, Field, PrivateAttr, field_validator, model_validator

from quantkit.data.calibration import SELECTIONS, STRATEGIES, CalibrationConfig
from quantkit.device import DEFAULT_DEVICE, check_device_name
from quantkit.errors import QuantkitError
from quantkit.eval.behaviour import BehaviourConfig
from quantkit.eval.evaluate import EvalConfig
from quantkit.export.run import COMPRESSED_TENSORS, OUTPUT_FORMATS
from quantkit.format.engines import LAYOUT_POLICIES
from quantkit.format.presets import PRESETS, preset
from quantkit.format.scheme import SUPPORTED_BITS, QuantScheme
from quantkit.mixed.candidates import DEFAULT_CANDIDATES
from quantkit.mixed.measurement import MODES, CandidateName, outer_spelling
from quantkit.mixed.outer_units import check_outer_candidates
from quantkit.mixed.sensitivity import SensitivityConfig
from quantkit.mixed.whole_plan import AUTO
from quantkit.model.precision import COMPUTE_DTYPE_NAMES
from quantkit.quantization.config import QuantizeConfig
from quantkit.quantization.methods.composition import DEFAULT_METHOD, JobSteps, resolve_scheme
from quantkit.recipes.legacy import upgrade_flat_keys
from quantkit.recipes.overrides import RecipeError, apply_overrides, env_substitution
from quantkit.recipes.solver_sections import configs_of, normalize_solvers, solvers_model
from quantkit.schemas.fields import FileModel, Regex, one_of
from quantkit.schemas.located import LocatedDict, load_yaml
from quantkit.schemas.validate import rule_error, validate
from quantkit.server.smoke import SMOKE_MAX_TOKENS

__all__ = [
    "BehaviourSection",
    "CalibrationSection",
    "EvaluationSection",
    "GatesSection",
    "MixedSection",
    "OutputSection",
    "QuantizationSection",
    "Recipe",
    "RecipeError",
    "SchemeSection",
    "SmokeSection",
    "dump_recipe",
    "load_recipe",
    "recipe_from_text",
    "recipe_to_dict",
]

Strategy = one_of(STRATEGIES)
Selection = one_of(SELECTIONS)
Bits = one_of(SUPPORTED_BITS)
Mode = one_of(MODES)


def _outer_choice(value: str) -> str:
    value = value.strip().lower()
    return value if value == AUTO else outer_spelling(value)


OuterChoice = Annotated[str, AfterValidator(_outer_choice)]  # a head/embedding scheme (none: float), or auto
LayoutPolicy = one_of(LAYOUT_POLICIES)
ComputeDtype = one_of(COMPUTE_DTYPE_NAMES)
Preset = one_of(PRESETS)
SolversSection = solvers_model()
OutputFormat = one_of(OUTPUT_FORMATS)


class CalibrationSection(FileModel):
    dataset: str | None = CalibrationConfig.dataset  # file, directory or HF dataset; None: the shipped corpus
    num_samples: int = Field(CalibrationConfig.num_samples, ge=1)
    seq_len: int = Field(CalibrationConfig.seq_len, ge=2)
    seed: int = CalibrationConfig.seed
    strategy: Strategy = CalibrationConfig.strategy
    select: Selection = CalibrationConfig.select
    min_length: int | None = Field(CalibrationConfig.min_length, ge=1)
    text_column: str = CalibrationConfig.text_column
    # use a text that covers under a quarter of the requested tokens; left out of dumps (and so of the recipe
    # cache keys made from them) while false, so keys made before this field existed stay valid
    allow_small: bool = Field(CalibrationConfig.allow_small, exclude_if=lambda value: not value)


class SchemeSection(FileModel):
    preset: Preset | None = None  # W4A16 ... as compressed-tensors names them; the keys below, when given, win
    bits: Bits | None = None  # None: the preset's, else QuantScheme's
    group_size: int | None = None  # -1: per-channel; None: the preset's, else QuantScheme's
    symmetric: bool | None = None  # None: the preset's, else the method's default (asymmetric for AWQ)
    act_order: bool | None = None  # None: the method's default (on for gptq and awq+gptq)
    static_groups: bool | None = None  # None: the method's default (on: no g_idx)
    mse_clip: bool | None = None  # None: the method's default (on for gptq: Hessian-weighted)

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, value: int | None) -> int | None:
        """A positive size, or -1 for one group per output channel."""
        if value is not None and (value == 0 or value < -1):
            raise ValueError(f"expected a positive size such as 64 or 128, or -1, got {value}")
        return value

    def resolve(self, defaults: dict[str, bool]) -> QuantScheme:
        """The scheme: each key given wins, then the preset's layout, then the method's ``defaults``."""
        fields = self.model_dump(exclude={"preset"})
        return resolve_scheme(defaults, None if self.preset is None else preset(self.preset), **fields)


class MixedSection(FileModel):
    target_bits: float | None = Field(None, gt=0)
    max_size_mb: float | None = Field(None, gt=0)
    candidates: list[CandidateName] = Field(default_factory=lambda: list(DEFAULT_CANDIDATES), min_length=1)
    pins: dict[Regex, CandidateName] = Field(default_factory=dict)  # regex -> candidate
    mode: Mode = SensitivityConfig.mode
    # as `quantkit plan --whole-model`: max_size_mb counts the whole checkpoint; head and embedding: a scheme as
    # --quantize-head spells it, or auto (measured by `sensitivity --outer` with outer_candidates, then planned)
    whole_model: bool = False
    head: OuterChoice = "none"
    embedding: OuterChoice = "none"
    outer_candidates: list[str] = Field(default_factory=lambda: list(SensitivityConfig().outer_candidates))

    @model_validator(mode="after")
    def _one_budget(self) -> MixedSection:
        if (self.target_bits is None) == (self.max_size_mb is None):
            raise rule_error("give exactly one budget: target_bits (e.g. 4.5) or max_size_mb")
        if not self.whole_model and (self.head, self.embedding) != ("none", "none"):
            raise rule_error("head and embedding are planned in a whole-model budget: set whole_model: true")
        if self.whole_model and self.max_size_mb is None:
            raise rule_error("whole_model budgets the checkpoint's bytes: give max_size_mb, not target_bits")
        if self.measures_outer:
            if self.mode == "proxy":
                raise rule_error("head/embedding auto are measured by final-logit KL: use mode hybrid or kl", "mode")
            try:
                check_outer_candidates(self.outer_candidates)
            except QuantkitError as exc:
                raise rule_error(str(exc), "outer_candidates") from None
        return self

    @property
    def measures_outer(self) -> bool:
        """The sensitivity stage measures the head and the embedding as units (one of them is auto)."""
        return AUTO in (self.head, self.embedding)


class QuantizationSection(FileModel):
    scheme: SchemeSection = Field(default_factory=SchemeSection)
    # the algorithms, by name (recipes/solver_sections.py); default: the default method's
    solvers: SolversSection = Field(default_factory=lambda: SolversSection(**{DEFAULT_METHOD: {}}))  # type: ignore[valid-type]
    ignore: list[Regex] = Field(default_factory=list)
    layout_policy: LayoutPolicy = QuantizeConfig.layout_policy  # layouts engines refuse: strict/fallback/...
    batch_size: int = Field(QuantizeConfig.batch_size, ge=1)  # calibration windows per forward pass
    compute_dtype: ComputeDtype = QuantizeConfig.compute_dtype  # the forward passes' products (model/precision.py)
    mixed: MixedSection | None = None  # a per-unit plan under a bit budget, instead of one scheme
    plan: str | None = None  # an existing plan YAML (quantkit plan), instead of one scheme

    @field_validator("scheme", mode="before")
    @classmethod
    def _preset_name(cls, value: Any) -> Any:
        """``scheme: W4A16`` is short for ``scheme: {preset: W4A16}``."""
        return {"preset": value} if isinstance(value, str) else value

    @field_validator("solvers", mode="before")
    @classmethod
    def _solvers_forms(cls, value: Any) -> Any:
        return normalize_solvers(value)

    @model_validator(mode="after")
    def _one_source_of_schemes(self) -> QuantizationSection:
        if self.mixed is not None and self.plan is not None:
            raise rule_error("give either 'mixed' or 'plan', not both", "plan")
        if (self.mixed is not None or self.plan is not None) and "scheme" in self.model_fields_set:
            raise rule_error(
                "a scheme does not apply with 'mixed' or 'plan' (the plan picks a scheme per layer); remove it",
                "scheme",
            )
        return self

    def solver_configs(self) -> list[Any]:
        """The algorithm configs of ``solvers``, in run order."""
        return configs_of(self.solvers)

    def quant_scheme(self) -> QuantScheme:
        """The scheme to quantize with; keys left null take the preset's, then the method's defaults."""
        return self.scheme.resolve(JobSteps(self.solver_configs()).scheme_defaults())


class OutputSection(FileModel):
    directory: str
    force: bool = False  # replace an existing directory that does not hold this recipe's checkpoint
    formats: list[OutputFormat] = Field(default_factory=lambda: [COMPRESSED_TENSORS], min_length=1)

    @field_validator("formats")
    @classmethod
    def _formats(cls, value: list[str]) -> list[str]:
        """The compressed-tensors checkpoint is always written: the exports are made from its integer codes."""
        if COMPRESSED_TENSORS not in value:
            raise ValueError(
                f"list {COMPRESSED_TENSORS} too (the exports are made from it), e.g. [{COMPRESSED_TENSORS}, gguf]"
            )
        return list(dict.fromkeys(value))

    def export_formats(self) -> list[str]:
        return [f for f in self.formats if f != COMPRESSED_TENSORS]

    # llama.cpp mixes (Q4_K_M, Q6_K, ...) solved from the float model with the recipe's solver and calibration,
    # each written as <directory>.<MIX>.gguf (quantkit/recipes/gguf_stage.py)
    gguf: list[str] = Field(default_factory=list)

    @field_validator("gguf")
    @classmethod
    def _gguf_mixes(cls, value: list[str]) -> list[str]:
        from quantkit.quantization.gguf.mixes import MIXES

        unknown = [m for m in value if m.upper() not in MIXES]
        if unknown:
            raise ValueError(f"unknown GGUF mix '{unknown[0]}'; use one of {', '.join(MIXES)}")
        return list(dict.fromkeys(m.upper() for m in value))


class BehaviourSection(FileModel):
    """Greedy replies to the shipped chat prompts (quantkit.eval.behaviour), the checkpoint's and the reference's."""

    prompts: int = Field(BehaviourConfig.prompts, ge=1)
    max_new_tokens: int = Field(BehaviourConfig.max_new_tokens, ge=1)

    def config(self, show_progress: bool) -> BehaviourConfig:
        return BehaviourConfig(prompts=self.prompts, max_new_tokens=self.max_new_tokens, show_progress=show_progress)


class EvaluationSection(FileModel):
    dataset: str | None = EvalConfig.dataset  # None: the shipped held-out text
    windows: int | None = Field(EvalConfig.max_windows, ge=1)  # None: every window
    seq_len: int = Field(EvalConfig.seq_len, ge=2)
    reference: str | None = EvalConfig.reference  # None: the recipe's model
    batch_size: int = Field(EvalConfig.batch_size, ge=1)
    behaviour: BehaviourSection | None = None  # None: no replies generated (the behaviour gates need them)

    @field_validator("behaviour", mode="before")
    @classmethod
    def _switch(cls, value: Any) -> Any:
        """``behaviour: true`` is short for the defaults, ``false`` for off (as ``solvers`` reads ``true``)."""
        if isinstance(value, bool):
            return {} if value else None
        return value


# the gates read from the behaviour figures: each needs evaluation.behaviour
BEHAVIOUR_GATES = ("min_end_rate", "max_repetition_increase", "min_first32_agreement", "min_tag_close_rate")


class GatesSection(FileModel):
    max_ppl_increase_pct: float | None = None
    max_kl_mean: float | None = Field(None, ge=0)
    min_top1_agreement: float | None = Field(None, ge=0, le=1)
    # of the block linears' weights (params; embeddings, head and norms aside), the part written quantized
    min_quantized_fraction: float | None = Field(None, ge=0, le=1)
    # the whole checkpoint's safetensors files, in MB (10^6 bytes): what users download and compare at equal size
    max_checkpoint_mb: float | None = Field(None, gt=0)
    min_end_rate: float | None = Field(None, ge=0, le=1)  # share of the checkpoint's replies that end
    # the checkpoint's repetition (share of repeated 4-grams) minus the reference's
    max_repetition_increase: float | None = Field(None, ge=-1, le=1)
    min_first32_agreement: float | None = Field(None, ge=0, le=1)  # first 32 reply tokens equal to the reference's
    # the share of replies that open a reasoning tag and close it; checked only where the template has such tags
    min_tag_close_rate: float | None = Field(None, ge=0, le=1)


class SmokeSection(FileModel):
    enabled: bool = False
    prompts: list[str] | None = None  # None: the smoke module's default prompts
    max_tokens: int = Field(SMOKE_MAX_TOKENS, ge=1)


class Recipe(FileModel):
    _secrets: dict[str, str] = PrivateAttr(default_factory=dict)  # ${VAR} name -> value, redacted from reports
    model: str
    output: OutputSection
    calibration: CalibrationSection = Field(default_factory=CalibrationSection)
    quantization: QuantizationSection = Field(default_factory=QuantizationSection)
    evaluation: EvaluationSection = Field(default_factory=EvaluationSection)
    gates: GatesSection = Field(default_factory=GatesSection)
    smoke: SmokeSection = Field(default_factory=SmokeSection)
    device: str = DEFAULT_DEVICE  # sensitivity, quantize and evaluation run here (auto, cpu, cuda, cuda:N)

    @model_validator(mode="after")
    def _behaviour_for_its_gates(self) -> Recipe:
        if self.evaluation.behaviour is None:
            for name in BEHAVIOUR_GATES:
                if getattr(self.gates, name) is not None:
                    raise rule_error(f"{name} gates the replies: add 'behaviour: true' to evaluation", "gates", name)
        return self

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        """The name's form only: a recipe written for a GPU machine validates anywhere (run checks the machine)."""
        try:
            return check_device_name(value)
        except QuantkitError as exc:
            raise ValueError(str(exc).removeprefix("device ")) from None  # the key path already says "device"


def recipe_from_text(text: str, label: str = "recipe", overrides: list[str] | None = None) -> Recipe:
    """The validated recipe of a YAML text after ``${VAR}`` substitution and ``overrides`` (``a.b=c``).

    Raises RecipeError naming ``label:line``, the key path and the problem.
    """
    secrets: dict[str, str] = {}
    data = load_yaml(text, label, error=RecipeError, on_string=env_substitution(label, secrets))
    if data is None:
        raise RecipeError(f"{label}: the recipe is empty; start from `quantkit recipe new`")
    if isinstance(data, LocatedDict):  # otherwise validation says what the recipe should be
        apply_overrides(data, list(overrides or []), label, secrets)
        try:
            upgrade_flat_keys(data.get("quantization"), label)
        except QuantkitError as exc:
            raise RecipeError(str(exc)) from None
    recipe = validate(Recipe, data, label, error=RecipeError)
    recipe._secrets = secrets
    return recipe


def recipe_secrets(recipe: Recipe) -> dict[str, str]:
    """The values of secret-named ``${VAR}`` substitutions (``HF_TOKEN``, ``*_API_KEY``...), by variable name."""
    return dict(recipe._secrets)


def load_recipe(path: Path | str, overrides: list[str] | None = None) -> Recipe:
    """The validated recipe of a file, after ``${VAR}`` substitution and ``overrides``."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file '{path}' not found; create one with `quantkit recipe new -o {path}`")
    return _with_plan_found(recipe_from_text(path.read_text(), str(path), overrides), path)


def _with_plan_found(recipe: Recipe, path: Path) -> Recipe:
    """A relative ``plan`` is read beside the recipe file (a shipped recipe names its shipped plan), else from the
    current directory (as before); a plan found in neither is refused before any stage runs."""
    plan = recipe.quantization.plan
    if plan is None:
        return recipe
    candidates = [Path(plan)] if Path(plan).is_absolute() else [path.parent / plan, Path(plan)]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise RecipeError(
            f"quantization.plan: plan file '{plan}' not found (a relative path is read beside the recipe, in "
            f"'{path.parent}', then in the current directory); write one with `quantkit plan MEASUREMENT -o {plan}`"
        )
    quantization = recipe.quantization.model_copy(update={"plan": str(found)})
    return recipe.model_copy(update={"quantization": quantization})


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """Plain data; a None equal to the key's default is left out, and so is the scheme under mixed or plan."""
    exclude = _none_defaults(recipe)
    if recipe.quantization.mixed is not None or recipe.quantization.plan is not None:
        exclude.setdefault("quantization", {})["scheme"] = True
    return recipe.model_dump(exclude=exclude)


def _none_defaults(section: BaseModel) -> dict[str, Any]:
    """A ``model_dump`` exclude spec: every key, at any depth, that is None where its default is None."""
    spec: dict[str, Any] = {}
    for name, info in type(section).model_fields.items():
        value = getattr(section, name)
        if value is None and info.default is None:
            spec[name] = True
        elif isinstance(value, BaseModel) and (inner := _none_defaults(value)):
            spec[name] = inner
    return spec


def dump_recipe(recipe: Recipe) -> str:
    """The recipe as YAML text that loads back to an equal recipe."""
    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, default_flow_style=False, width=1000)
