"""Promotion: publication to the first shared tier, copies down the tiers, buddy copies, fills."""
