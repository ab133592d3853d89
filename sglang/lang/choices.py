"""How `select` decides between choices from the logprobs of each continuation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

# A logprob entry is [logprob | None, token_id, token_text | None]; the first prompt entry is always null.
LogprobList = list[list[Any]]


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: Optional[dict[str, Any]] = None


def _value(entry: list[Any]) -> float:
    # A null logprob (the first position of a prompt) carries no evidence: count it as 0.
    return float(entry[0]) if entry[0] is not None else 0.0


def compute_normalized_prompt_logprobs(input_logprobs: LogprobList) -> float:
    values = [entry[0] for entry in input_logprobs if entry[0]]
    return sum(values) / len(values) if values else 0.0


class ChoicesSamplingMethod:
    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: list[LogprobList], output_token_logprobs: list[LogprobList],
                 unconditional_token_logprobs: Optional[list[LogprobList]] = None) -> ChoicesDecision:
        raise NotImplementedError()


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean logprob per token."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        best = choices[int(np.argmax(normalized_prompt_logprobs))]
        return ChoicesDecision(best, {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
        })


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare token by token: keep the choices with the best logprob at each position until one is left.

    Shorter choices are padded with their own mean logprob."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        matrix = self.build_logprob_matrix(input_token_logprobs)
        remaining = np.arange(len(choices))
        for j in range(matrix.shape[1]):
            column = matrix[remaining, j]
            remaining = remaining[column == column.max()]
            if len(remaining) == 1:
                break
        best = choices[int(remaining[0])]
        return ChoicesDecision(best, {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            "greedy_logprob_matrix": matrix.tolist(),
        })

    @staticmethod
    def build_logprob_matrix(input_token_logprobs: list[LogprobList]) -> np.ndarray:
        max_tokens = max(len(option) for option in input_token_logprobs)
        matrix = np.full((len(input_token_logprobs), max_tokens), -np.inf)
        for i, option in enumerate(input_token_logprobs):
            values = [_value(entry) for entry in option]
            matrix[i, : len(values)] = values
            if len(values) < max_tokens:
                matrix[i, len(values):] = np.mean(values)
        return matrix


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """Mean of (conditional - unconditional) logprob per token: discounts choices that are likely anyway."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("Unconditional token logprobs are required for this method.")
        normalized = self.normalize(input_token_logprobs, unconditional_token_logprobs)
        best = choices[int(np.argmax(normalized))]
        return ChoicesDecision(best, {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            "unconditional_token_logprobs": unconditional_token_logprobs,
            "normalized_unconditional_prompt_logprobs": normalized,
        })

    @staticmethod
    def normalize(input_token_logprobs: list[LogprobList],
                  unconditional_token_logprobs: list[LogprobList]) -> list[float]:
        out = []
        for inputs, unconditionals in zip(input_token_logprobs, unconditional_token_logprobs):
            cond = np.array([_value(entry) for entry in inputs])
            uncond = np.array([_value(entry) for entry in unconditionals])
            out.append(float(np.mean(cond - uncond)))
        return out


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
