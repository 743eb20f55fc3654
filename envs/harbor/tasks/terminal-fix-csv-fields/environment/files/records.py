def parse_line(line):
    return line.split(",")
