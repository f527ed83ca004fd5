"""The Transformers integration: ``compile_for_generate`` (static cache, chunked prefill) and
``compile_for_encoder`` (bucketed encoder inputs). It builds on the device and host paths and
on ``aot``; neither path imports it (the backend reads its recompile and cache-growth checks)."""
