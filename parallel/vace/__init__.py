"""VACE: input builders and the native VACE conditioning format; runs in the driver process (builders, encode assembly) and the workers (model context)."""
