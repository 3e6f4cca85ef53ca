"""Which kernel serves which shape, measured on the device: GEMV selection and its timing,
whole-step tuning of the plan, the verify steps' own tiles."""
