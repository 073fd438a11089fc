"""Model backends behind the one predictor contract (`stoker.core.model.Predictor`)."""
