// What the consumers (ufs_emulator.cpp, soca_icenet.cpp) share on the command line: the one error line, and the
// input rows of a CSV file (one point per line, comma-separated numbers; a first line that is not numeric is a
// header).
#pragma once

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

inline int fail(const std::string& message) {
  std::cerr << "error: " << message << std::endl;
  return 2;
}

inline std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

inline std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::stringstream cells(text);
  std::string cell;
  while (std::getline(cells, cell, separator)) parts.push_back(cell);
  return parts;
}

inline bool parse_row(const std::string& line, std::vector<double>& row) {
  row.clear();
  for (const auto& cell : split(line, ',')) {
    char* end = nullptr;
    double value = std::strtod(cell.c_str(), &end);
    if (end == cell.c_str()) return false;
    row.push_back(value);
  }
  return !row.empty();
}

// The rows of csv_path, each of `width` values; "" when they are read, else the one-line reason (`taker`, e.g.
// "the model", names what takes `width` inputs).
inline std::string read_rows(const std::string& csv_path, size_t width, const std::string& taker,
                             std::vector<std::vector<double>>& rows) {
  std::ifstream csv(csv_path);
  if (!csv) return csv_path + " cannot be read";
  std::vector<double> row;
  std::string line;
  size_t line_number = 0;
  while (std::getline(csv, line)) {
    ++line_number;
    if (line.empty()) continue;
    if (!parse_row(line, row)) {
      if (line_number == 1) continue;  // a header
      return csv_path + " line " + std::to_string(line_number) + " is not numeric";
    }
    if (row.size() != width)
      return csv_path + " line " + std::to_string(line_number) + " has " + std::to_string(row.size()) +
             " values; " + taker + " takes " + std::to_string(width);
    rows.push_back(row);
  }
  if (rows.empty()) return csv_path + " holds no input rows";
  return "";
}
