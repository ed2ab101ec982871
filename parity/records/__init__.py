"""After Linen: a side's battery results recorded (`parity.record`), standing for it once deleted (`parity.recorded`)."""
