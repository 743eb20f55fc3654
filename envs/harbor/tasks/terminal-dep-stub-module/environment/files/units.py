from conversions import km_to_miles, miles_to_km

def marathon_miles():
    return round(km_to_miles(42.195), 2)
