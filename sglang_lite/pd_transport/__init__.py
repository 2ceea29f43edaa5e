"""Prefill/decode disaggregation's transport: the Mooncake transfer engine and the memory layout a decode rank
publishes so that a prefill rank can write a request's KV, GDN states and first token straight into it."""
