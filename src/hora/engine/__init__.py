"""The background engine: tensor queue, negotiation, fusion and execution of collectives."""
