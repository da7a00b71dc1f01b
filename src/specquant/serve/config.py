"""ServeConfig: the one home of the server's defaults and request limits (the drafters' settings when serving are
their rows': spec_decode/drafters, serve_options); LatencyConfig: `specquant latency`'s."""

from __future__ import annotations

from dataclasses import dataclass, field

from specquant.errors import SpecquantError, require_positive


@dataclass
class ServeConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "TCP port to listen on"})
    model_name: str = field(default="", metadata={
        "help": "the model id clients send and /v1/models lists (default: the target's directory name)"})
    # requests admitted at once: the one running plus those waiting for the engine worker (batch 1)
    max_queue: int = field(default=64, metadata={
        "help": "requests admitted at once (running + waiting); one more is answered 503 with Retry-After"})
    retry_after_s: int = field(default=1, metadata={"help": "the Retry-After seconds a 503 carries"})
    max_tokens_limit: int = field(default=4096, metadata={"help": "the largest max_tokens a request may ask for"})
    default_max_tokens: int = field(default=256, metadata={
        "help": "max_tokens when a request gives none (cut to what the context leaves)"})
    max_temperature: float = field(default=2.0, metadata={"help": "the largest temperature a request may ask for"})
    max_stop: int = field(default=4, metadata={"help": "the most stop strings a request may give"})
    max_stop_chars: int = field(default=64, metadata={"help": "the longest stop string, in characters"})
    chat_template: str = field(default="", metadata={
        "help": "chat template for /v1/chat/completions when the tokenizer has none: a Jinja file, or 'chatml' "
                "(<|im_start|>role\\ncontent<|im_end|>); empty: the tokenizer's own (chat is refused without one)"})
    # uvicorn waits for open streams before the engine worker stops; past this, their generations are cancelled
    shutdown_timeout_s: int = field(default=5, metadata={
        "help": "seconds a shutdown waits for running requests before cancelling them"})
    mal_window: int = field(default=32, metadata={
        "help": "requests the rolling mean-acceptance-length gauge averages over"})
    # 0 disables the warning; acceptance collapse under a quantized target shows as MAL falling towards 1
    mal_warn_below: float = field(default=1.5, metadata={
        "help": "log a warning when the rolling mean acceptance length drops below this (0 = never)"})
    # off by default: it holds device memory, and a hybrid target then prefills in prefix_cache_block pieces
    prefix_cache: bool = field(default=False, metadata={
        "store_true": True, "help": "reuse the cache state of an earlier prompt's shared prefix (serve/prefix.py)"})
    prefix_cache_entries: int = field(default=16, metadata={"help": "prompts the prefix cache keeps (LRU)"})
    prefix_cache_mib: int = field(default=2048, metadata={
        "help": "the most MiB of snapshots the prefix cache keeps, on the model's device (LRU)"})
    # a recurrent state (Qwen3.5 DeltaNet) cannot be cut: snapshots every this many tokens are where a diverging
    # prompt can resume
    prefix_cache_block: int = field(default=256, metadata={
        "help": "tokens between the restore points of states that cannot be cut at any length (DeltaNet, rings)"})

    def validate(self) -> "ServeConfig":
        require_positive(self, ("max_queue", "max_tokens_limit", "default_max_tokens", "max_stop", "max_stop_chars",
                                "mal_window", "prefix_cache_entries", "prefix_cache_mib", "prefix_cache_block"),
                         prefix="serve ")
        if not 0 <= self.port <= 65535:
            raise SpecquantError(f"port {self.port} is outside 0..65535 (0: any free port)")
        if self.shutdown_timeout_s < 0:
            raise SpecquantError(f"shutdown_timeout_s {self.shutdown_timeout_s} is negative; use 0 or more seconds")
        if self.retry_after_s < 0:
            raise SpecquantError(f"retry_after_s {self.retry_after_s} is negative; use 0 or more seconds")
        if not self.max_temperature >= 0:
            raise SpecquantError(f"max_temperature {self.max_temperature} must be >= 0")
        if self.mal_warn_below < 0:
            raise SpecquantError(f"mal_warn_below {self.mal_warn_below} is negative; use 0 to switch it off")
        return self


# the competition's categories: prompt tokens -> new tokens (../shared/PEERS.md)
CATEGORIES = {"short": (64, 128), "medium": (2048, 256), "long": (8192, 256)}
FILLER = "The quick brown fox jumps over the lazy dog. "


@dataclass
class LatencyConfig:
    categories: list[str] = field(default_factory=lambda: list(CATEGORIES), metadata={
        "help": "categories to run (comma- or space-separated), from "
                + ", ".join(f"{k} ({p} -> {n})" for k, (p, n) in CATEGORIES.items())})
    runs: int = field(default=50, metadata={"help": "timed requests per category"})
    warmup: int = field(default=5, metadata={"help": "untimed requests before each category's runs"})
    prompt: str = field(default="filler", metadata={
        "help": "'filler' (the competition's repeated sentence) or a text file, repeated or cut to length"})
    temperature: float = field(default=0.0, metadata={"help": "request temperature (the protocol: 0)"})
    timeout_s: float = field(default=600.0, metadata={"help": "per-request timeout, seconds"})

    def validate(self) -> "LatencyConfig":
        require_positive(self, ("runs",), prefix="latency ")
        self.categories = [c for item in self.categories for c in item.split(",") if c]  # short,long or short long
        bad = [c for c in self.categories if c not in CATEGORIES]
        if bad or not self.categories:
            raise SpecquantError(f"categories {','.join(bad) or '(none)'} unknown; use some of {','.join(CATEGORIES)}")
        if self.warmup < 0:
            raise SpecquantError(f"warmup {self.warmup} is negative; use 0 or more requests")
        if not self.timeout_s > 0:
            raise SpecquantError(f"timeout_s {self.timeout_s} must be positive")
        return self
