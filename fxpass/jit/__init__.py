"""The just-in-time path: ``torch.compile(model, backend="fxpass_<device>")``.

backend (rules -> partition -> region compile -> splice), guarded (weight variants and their
guards), shapes (static variants of a symbolic graph, buckets), plan and cache (the plan and
artifact caches, keyed by the device's identity), runtime (the spliced region call), options
and report. Nothing here names a device: the device arrives as an argument."""
