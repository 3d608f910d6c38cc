"""Recipes: one YAML file describing calibrate -> (sensitivity -> plan) -> quantize -> evaluate -> gates -> smoke.

The schema is a tree of pydantic models; loading checks every key against it. Errors name the file, the line
and the key path, say what was expected, and suggest the closest valid key or choice for a typo. String values
may use ``${VAR}`` or ``${VAR:-default}`` and ``--set a.b=c`` overrides any key (see
:mod:`quantkit.recipes.overrides`). Each default is the one of the config class that uses the value. Relative
paths are relative to the current directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from quantkit.data.calibration import SELECTIONS, STRATEGIES, CalibrationConfig
from quantkit.device import DEFAULT_DEVICE, check_device_name
from quantkit.errors import QuantkitError
from quantkit.eval.evaluate import EvalConfig
from quantkit.export.run import COMPRESSED_TENSORS, OUTPUT_FORMATS
from quantkit.format.engines import LAYOUT_POLICIES
from quantkit.format.scheme import SUPPORTED_BITS, QuantScheme
from quantkit.mixed.candidates import DEFAULT_CANDIDATES
from quantkit.mixed.measurement import MODES, CandidateName
from quantkit.mixed.sensitivity import SensitivityConfig
from quantkit.quantization.config import DEFAULT_METHOD, QuantizeConfig
from quantkit.quantization.methods import METHODS, check_float_targets, resolve_scheme
from quantkit.quantization.solvers.gptq import GPTQConfig
from quantkit.quantization.solvers.tune import TuneConfig
from quantkit.recipes.overrides import RecipeError, apply_overrides, env_substitution
from quantkit.rotation.config import ROTATION_KINDS, RotationConfig
from quantkit.schemas.fields import FileModel, Regex, one_of
from quantkit.schemas.located import LocatedDict, load_yaml
from quantkit.schemas.validate import rule_error, validate

__all__ = [
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

SMOKE_MAX_TOKENS = 16
Strategy = one_of(STRATEGIES)
Selection = one_of(SELECTIONS)
Bits = one_of(SUPPORTED_BITS)
Mode = one_of(MODES)
Method = one_of(METHODS)
LayoutPolicy = one_of(LAYOUT_POLICIES)
RotationKind = one_of(ROTATION_KINDS)
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
    bits: Bits = QuantScheme.bits
    group_size: int = QuantScheme.group_size  # -1: per-channel
    symmetric: bool | None = None  # None: the method's default (asymmetric for AWQ, as in AutoAWQ)
    act_order: bool | None = None  # None: the method's default (on for gptq and awq+gptq)
    static_groups: bool | None = None  # None: the method's default (on: no g_idx)
    mse_clip: bool | None = None  # None: the method's default (on for gptq: Hessian-weighted)

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, value: int) -> int:
        """A positive size, or -1 for one group per output channel."""
        if value == 0 or value < -1:
            raise ValueError(f"expected a positive size such as 64 or 128, or -1, got {value}")
        return value


class MixedSection(FileModel):
    target_bits: float | None = Field(None, gt=0)
    max_size_mb: float | None = Field(None, gt=0)
    candidates: list[CandidateName] = Field(default_factory=lambda: list(DEFAULT_CANDIDATES), min_length=1)
    pins: dict[Regex, CandidateName] = Field(default_factory=dict)  # regex -> candidate
    mode: Mode = SensitivityConfig.mode

    @model_validator(mode="after")
    def _one_budget(self) -> MixedSection:
        if (self.target_bits is None) == (self.max_size_mb is None):
            raise rule_error("give exactly one budget: target_bits (e.g. 4.5) or max_size_mb")
        return self


class QuantizationSection(FileModel):
    method: Method = DEFAULT_METHOD
    scheme: SchemeSection = Field(default_factory=SchemeSection)
    damp: float = Field(GPTQConfig.damp, ge=0, lt=1)
    float_targets: bool = GPTQConfig.float_targets  # GPTQ toward the float model's outputs (GPTAQ)
    ignore: list[Regex] = Field(default_factory=list)
    rotate: RotationKind = RotationConfig().kind  # a rotation folded into the weights before solving
    rotate_seed: int = RotationConfig().seed
    tune_steps: int = Field(0, ge=0)  # block-output tuning steps per block (0: off)
    tune_lr: float = Field(TuneConfig.lr, gt=0)  # tuning: learning rate of the rounding offsets
    tune_scale_lr: float = Field(TuneConfig.scale_lr, gt=0)  # tuning: learning rate of the scale multipliers
    tune_batch_windows: int = Field(TuneConfig.batch_windows, ge=1)  # tuning: calibration windows per step
    refit_head: bool = QuantizeConfig.refit_head  # refit the float head to the quantized body
    layout_policy: LayoutPolicy = QuantizeConfig.layout_policy  # layouts engines refuse: strict/fallback/...
    mixed: MixedSection | None = None  # a per-unit plan under a bit budget, instead of one scheme
    plan: str | None = None  # an existing plan YAML (quantkit plan), instead of one scheme

    @model_validator(mode="after")
    def _float_targets_need_gptq(self) -> QuantizationSection:
        try:
            check_float_targets(self.method, self.float_targets)
        except QuantkitError as error:
            raise rule_error(str(error), "float_targets") from None
        return self

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

    def rotation(self) -> RotationConfig:
        return RotationConfig(kind=self.rotate, seed=self.rotate_seed)  # type: ignore[arg-type]

    def quant_scheme(self) -> QuantScheme:
        """The scheme to quantize with; options left null take the method's defaults."""
        s = self.scheme
        return resolve_scheme(
            self.method,
            bits=s.bits,
            group_size=s.group_size,
            symmetric=s.symmetric,
            act_order=s.act_order,
            static_groups=s.static_groups,
            mse_clip=s.mse_clip,
        )


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


class EvaluationSection(FileModel):
    dataset: str | None = EvalConfig.dataset  # None: the shipped held-out text
    windows: int | None = Field(EvalConfig.max_windows, ge=1)  # None: every window
    seq_len: int = Field(EvalConfig.seq_len, ge=2)
    reference: str | None = EvalConfig.reference  # None: the recipe's model
    batch_size: int = Field(EvalConfig.batch_size, ge=1)


class GatesSection(FileModel):
    max_ppl_increase_pct: float | None = None
    max_kl_mean: float | None = Field(None, ge=0)
    min_top1_agreement: float | None = Field(None, ge=0, le=1)


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
    return recipe_from_text(path.read_text(), str(path), overrides)


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
