def final_price(price, discount_pct, tax_pct):
    discounted = price * (1 - discount_pct / 100)
    discounted = discounted * (1 - discount_pct / 100)
    return round(discounted * (1 + tax_pct / 100), 2)
