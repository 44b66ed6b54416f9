"""The errors a user can fix: each message is one sentence saying what is wrong and what to do (megatrain.config
re-exports them, beside the configs whose checks raise most of them)."""

from __future__ import annotations


class MegatrainError(Exception):
    """An error a user can fix: the message is one sentence saying what is wrong and what to do."""


def cause_chain(e: BaseException, depth: int = 8) -> list[BaseException]:
    """`e` and the errors Ray wrapped inside it (RayTaskError.cause, possibly nested), outermost first."""
    chain = [e]
    while len(chain) < depth and isinstance(getattr(chain[-1], "cause", None), BaseException):
        chain.append(chain[-1].cause)  # type: ignore[attr-defined]
    return chain


class ConfigError(MegatrainError):
    pass


class NotNative(ConfigError):
    """An option its native family does not implement (an invalid config is a plain ConfigError): ModelConfig.from_hf
    trains such a model on the generic path (transformers' own layers), and refuses it so only without transformers."""

    def __init__(self, model_type: str, option: str, why: str):
        super().__init__(f"megatrain's native {model_type} layer does not implement {option} ({why}), and the generic "
                         "path that would train it needs transformers; install it with pip install -e '.[hf]'.")
        self.option = option


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived during a run: it stops as after Ctrl-C (the CLI exits with 143 rather than 130)."""
