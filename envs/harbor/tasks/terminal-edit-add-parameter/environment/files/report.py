from names import join_names

def summary(team):
    return "Team: " + join_names(team)
